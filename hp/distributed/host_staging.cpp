// with_host_staging: a Comm decorator that carries tensors of any device over
// a CPU backend by staging them through host memory; how ranks that share
// one GPU exchange CUDA activations (NOTE [Staging through host memory]).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <memory>
#include <string>
#include <vector>

#include "hp/distributed/comm.h"

namespace hp::distributed {
namespace {

// NOTE [Staging through host memory]
// NCCL refuses a communicator whose ranks share a device, and a lent GPU
// machine has one GPU; yet the pipeline's ranks must be tested against
// single-process training there. The choices were Gloo's own CUDA support
// (ProcessGroupGloo stages some collectives of CUDA tensors, but not
// send/recv), CUDA IPC in the shared-memory transport (fast, but a second
// device transport to keep for a test-only case), and this: a decorator
// over any CPU Comm (Gloo, or shared memory over Gloo) that moves every
// device tensor through a host buffer.
// * A send copies the tensor to a host buffer (pinned for CUDA) on the
//   calling thread - the copy waits for the compute that produced it, a host
//   synchronization - and posts the buffer on `inner`.
// * A receive posts `inner`'s receive into a host buffer; its wait() waits
//   for that on the host, then copies into the caller's tensor on the
//   caller's current stream (asynchronously from pinned memory; the caching
//   host allocator keeps the buffer until the copy ran).
// * Collectives copy in, run on `inner`, copy out; split() stages the subgroup.
// `inner` sees CPU tensors in exactly the order the caller posted them, in
// the same batches, so the protocol (NOTE [Point-to-point without tags]) is
// unchanged. Every transfer synchronizes the host with the device: this is
// the correct way for ranks on one GPU, not a fast one (NCCL is, on
// separate GPUs). With `stage_cpu_tensors` CPU tensors take the same path
// through fresh buffers: the CPU tests of this file's logic.
class HostStagingComm : public Comm {
 public:
  HostStagingComm(std::shared_ptr<Comm> inner, HostStagingOptions options)
      : inner_(std::move(inner)), options_(options) {}

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  std::string backend_name() const override { return inner_->backend_name() + "+host"; }
  bool early_receives_are_free() const override { return inner_->early_receives_are_free(); }

  Work isend(const at::Tensor& tensor, int dst) override {
    return batch({P2POp::send(tensor, dst)})[0];
  }
  Work irecv(const at::Tensor& tensor, int src) override {
    return batch({P2POp::recv(tensor, src)})[0];
  }

  std::vector<Work> batch(const std::vector<P2POp>& ops) override {
    std::vector<P2POp> staged;
    std::vector<at::Tensor> hosts(ops.size());
    staged.reserve(ops.size());
    for (size_t i = 0; i < ops.size(); ++i) {
      const P2POp& op = ops[i];
      TORCH_CHECK(op.tensor.defined(), op.kind == P2POp::Kind::Send ? "isend" : "irecv",
                  ": the tensor is undefined");
      if (!stages(op.tensor)) {
        staged.push_back(op);
        continue;
      }
      hosts[i] = host_buffer(op.tensor);
      if (op.kind == P2POp::Kind::Send) hosts[i].copy_(op.tensor);  // waits for the producer
      staged.push_back({op.kind, hosts[i], op.peer});
    }
    std::vector<Work> inner_works = inner_->batch(staged);
    TORCH_INTERNAL_ASSERT(inner_works.size() == ops.size());
    std::vector<Work> works;
    works.reserve(ops.size());
    for (size_t i = 0; i < ops.size(); ++i) {
      if (!hosts[i].defined()) {
        works.push_back(inner_works[i]);
        continue;
      }
      auto w = std::make_shared<StagedWork>();
      w->inner = inner_works[i];
      w->host = hosts[i];
      if (ops[i].kind == P2POp::Kind::Recv) w->device = ops[i].tensor;
      works.push_back(Work(w));
    }
    return works;
  }

  void all_reduce(const at::Tensor& tensor, ReduceOp op) override {
    if (!stages(tensor)) return inner_->all_reduce(tensor, op);
    at::Tensor host = to_host(tensor);
    inner_->all_reduce(host, op);
    tensor.copy_(host);
  }

  void all_gather(std::vector<at::Tensor>& out, const at::Tensor& in) override {
    bool any = stages(in);
    for (const auto& t : out)
      any = any || (t.defined() && stages(t));
    if (!any) return inner_->all_gather(out, in);
    at::Tensor host_in = to_host(in);
    std::vector<at::Tensor> host_out;
    for (const auto& t : out)
      host_out.push_back(t.defined() ? host_buffer(t) : t);
    inner_->all_gather(host_out, host_in);
    for (size_t i = 0; i < out.size(); ++i)
      out[i].copy_(host_out[i]);
  }

  void broadcast(const at::Tensor& tensor, int root) override {
    if (!stages(tensor)) return inner_->broadcast(tensor, root);
    at::Tensor host = rank() == root ? to_host(tensor) : host_buffer(tensor);
    inner_->broadcast(host, root);
    if (rank() != root) tensor.copy_(host);
  }

  void barrier() override { inner_->barrier(); }
  void abandon(const std::string& why) override { inner_->abandon(why); }

  std::shared_ptr<Comm> split(const std::vector<int>& ranks) override {
    return std::make_shared<HostStagingComm>(inner_->split(ranks), options_);
  }

 private:
  // A staged operation: `inner`'s Work on the host buffer; a receive copies
  // the buffer into the caller's tensor once it arrived.
  struct StagedWork : Work::Impl {
    Work inner;
    at::Tensor host;    // the buffer `inner` moves; kept alive until the wait
    at::Tensor device;  // receives: where the data goes
    void wait() override {
      inner.wait();
      if (device.defined()) device.copy_(host, /*non_blocking=*/host.is_pinned());
      device = at::Tensor();
      host = at::Tensor();
    }
    std::optional<bool> test() const override { return inner.test(); }
  };

  bool stages(const at::Tensor& t) const {
    return !t.device().is_cpu() || options_.stage_cpu_tensors;
  }
  // A host tensor shaped like `t` (contiguous; pinned when `t` is on CUDA,
  // so that copies from it can run asynchronously).
  static at::Tensor host_buffer(const at::Tensor& t) {
    return at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(t.device().is_cuda()));
  }
  static at::Tensor to_host(const at::Tensor& t) {
    at::Tensor h = host_buffer(t);
    h.copy_(t);
    return h;
  }

  std::shared_ptr<Comm> inner_;
  HostStagingOptions options_;
};

}  // namespace

std::shared_ptr<Comm> with_host_staging(std::shared_ptr<Comm> inner, HostStagingOptions options) {
  TORCH_CHECK(inner != nullptr, "with_host_staging: no Comm given");
  return std::make_shared<HostStagingComm>(std::move(inner), options);
}

// NOTE [Ranks on devices]: a backend that takes device tensors is NCCL; every
// other (Gloo, shared memory over Gloo) moves host memory only.
std::shared_ptr<Comm> for_device(std::shared_ptr<Comm> comm, const c10::Device& device) {
  TORCH_CHECK(comm != nullptr, "for_device: no Comm given");
  if (device.is_cpu() || comm->backend_name().find("nccl") != std::string::npos) return comm;
  return with_host_staging(std::move(comm));
}

}  // namespace hp::distributed
