// The backend-independent parts of Comm: Work, torchrun environment parsing,
// and the collectives built from others (flat all-gather, ring reduce-scatter).
#include "hp/dist/comm.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdlib>
#include <exception>

#include "hp/dist/comm_internal.h"

namespace hp::dist {

void Work::wait() {
  TORCH_CHECK(impl_ != nullptr, "Work::wait() on an empty Work (default-constructed)");
  if (done_) return;
  done_ = true;  // a second wait after an error must not block again
  impl_->wait();
}

void wait_all(std::vector<Work>& works) {
  std::exception_ptr first;
  for (auto& w : works) {
    try {
      w.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

namespace {

const char* kEnvExample =
    "e.g. RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 (torchrun and "
    "`hp launch` set them)";

int env_int(const char* name, bool required, int fallback, int min_value) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') {
    TORCH_CHECK(!required, "environment variable ", name, " is not set; ", kEnvExample);
    return fallback;
  }
  char* end = nullptr;
  errno = 0;
  long x = std::strtol(v, &end, 10);
  TORCH_CHECK(errno == 0 && end != v && *end == '\0' && x >= min_value && x <= 1 << 30,
              "environment variable ", name, "='", v, "' is not an integer >= ", min_value, "; ",
              kEnvExample);
  return static_cast<int>(x);
}

}  // namespace

EnvConfig read_env() {
  EnvConfig c;
  c.rank = env_int("RANK", true, 0, 0);
  c.world_size = env_int("WORLD_SIZE", true, 1, 1);
  TORCH_CHECK(c.rank < c.world_size, "RANK=", c.rank,
              " must be smaller than WORLD_SIZE=", c.world_size, "; ", kEnvExample);
  c.local_rank = env_int("LOCAL_RANK", false, c.rank, 0);
  const char* addr = std::getenv("MASTER_ADDR");
  TORCH_CHECK(addr != nullptr && *addr != '\0', "environment variable MASTER_ADDR is not set; ",
              kEnvExample);
  c.master_addr = addr;
  c.master_port = env_int("MASTER_PORT", true, 0, 1);
  TORCH_CHECK(c.master_port <= 65535, "environment variable MASTER_PORT='", c.master_port,
              "' is not a TCP port (1..65535); ", kEnvExample);
  return c;
}

std::shared_ptr<Comm> Comm::from_env(const CommOptions& options) {
  EnvConfig c = read_env();
  CommOptions o = options;
  if (const char* t = std::getenv("HP_DIST_TIMEOUT_MS"); t != nullptr && *t != '\0') {
    char* end = nullptr;
    long ms = std::strtol(t, &end, 10);
    TORCH_CHECK(end != t && *end == '\0' && ms > 0, "environment variable HP_DIST_TIMEOUT_MS='", t,
                "' is not a positive number of milliseconds");
    o.timeout = std::chrono::milliseconds(ms);
  }
  return from_tcp(c.master_addr, c.master_port, c.rank, c.world_size, o);
}

void Comm::all_gather(const at::Tensor& out, const at::Tensor& in) {
  detail::check_tensor(out, "all_gather (output)");
  TORCH_CHECK(out.numel() == in.numel() * world_size(), "all_gather: the flat output has ",
              out.numel(), " elements; it needs world_size (", world_size(), ") x ", in.numel());
  TORCH_CHECK(out.scalar_type() == in.scalar_type(), "all_gather: output dtype ", out.scalar_type(),
              " differs from input dtype ", in.scalar_type());
  auto flat = out.view({-1});
  std::vector<at::Tensor> parts;
  for (int r = 0; r < world_size(); ++r)
    parts.push_back(flat.narrow(0, r * in.numel(), in.numel()).view(in.sizes()));
  all_gather(parts, in);
}

// Ring reduce-scatter: at step s rank r sends its partial slice (r-s-1) to
// r+1 and adds the slice (r-s-2) received from r-1; after world-1 steps slice r
// holds the full reduction. Summation order is fixed, so results are
// deterministic run to run.
//
// NOTE [Gloo's reduce_scatter in LibTorch 2.x]
// LibTorch 1.13's ProcessGroupGloo has no flat reduce-scatter. LibTorch 2.6's
// has one (_reduce_scatter_base), and we still do not use it: it clones the
// whole input, all-reduces all of it and copies out this rank's slice - twice
// the bytes of this ring on every rank - and it drops the reduce op on the
// way (its AllreduceOptions are built and never passed), so Max and Min come
// back as sums. Checked on Debian 13's LibTorch 2.6: a Max reduce-scatter of
// {1,5,3,2} and {4,2,1,6} gives rank 0 {5,7}, not {4,5}; and an output of
// another dtype than the input is a fatal CHECK there (the process aborts,
// nothing to catch), where we throw. Its flat all-gather
// (_allgather_base) is the same chunk-and-allgather as Comm::all_gather above.
void Comm::reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceOp op) {
  detail::check_tensor(out, "reduce_scatter (output)");
  detail::check_tensor(in, "reduce_scatter (input)");
  const int n = world_size(), r = rank();
  const int64_t m = out.numel();
  TORCH_CHECK(in.numel() == m * n, "reduce_scatter: the input has ", in.numel(),
              " elements; it needs world_size (", n, ") x output numel (", m, ")");
  TORCH_CHECK(out.scalar_type() == in.scalar_type(), "reduce_scatter: output dtype ",
              out.scalar_type(), " differs from input dtype ", in.scalar_type());
  TORCH_CHECK(op != ReduceOp::Avg || at::isFloatingType(in.scalar_type()),
              "reduce_scatter: Avg needs a floating dtype, got ", in.scalar_type());
  auto acc = in.reshape({-1}).clone();
  auto slice = [&](int i) { return acc.narrow(0, int64_t((i % n + n) % n) * m, m); };
  auto tmp = at::empty({m}, in.options());
  for (int s = 0; s < n - 1; ++s) {
    auto send = isend(slice(r - s - 1), (r + 1) % n, detail::kReduceScatterTag);
    auto recv = irecv(tmp, (r - 1 + n) % n, detail::kReduceScatterTag);
    std::vector<Work> works{send, recv};
    wait_all(works);
    auto dst = slice(r - s - 2);
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg:
        dst.add_(tmp);
        break;
      case ReduceOp::Max:
        at::maximum_out(dst, dst, tmp);
        break;
      case ReduceOp::Min:
        at::minimum_out(dst, dst, tmp);
        break;
    }
  }
  auto mine = slice(r);
  if (op == ReduceOp::Avg) mine.div_(n);
  out.view({-1}).copy_(mine);
}

}  // namespace hp::dist
