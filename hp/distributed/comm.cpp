// The backend-independent parts of Comm: Work, torchrun environment parsing,
// batches, and the collectives built from point-to-point (flat all-gather,
// ring reduce-scatter, the asynchronous direct exchanges).
#include "hp/distributed/comm.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdlib>
#include <exception>
#include <functional>
#include <utility>

#include "hp/distributed/comm_internal.h"

namespace hp::distributed {

namespace {
thread_local WaitObserver* t_wait_observer = nullptr;
}  // namespace

void Work::wait() {
  TORCH_CHECK(impl_ != nullptr, "Work::wait() on an empty Work (default-constructed)");
  if (done_) return;
  WaitObserver* observer = t_wait_observer;
  if (observer == nullptr) {
    done_ = true;  // a second wait after an error must not block again
    impl_->wait();
    return;
  }
  // NOTE [A wait that lets a partner compute] in comm.h
  t_wait_observer = nullptr;  // the parts of this wait, and what before_wait runs, are not seen
  try {
    observer->before_wait(*this);  // sees it not yet waited (its test() asks the backend)
  } catch (...) {
    done_ = true;
    t_wait_observer = observer;
    throw;
  }
  done_ = true;
  try {
    impl_->wait();
  } catch (...) {
    t_wait_observer = observer;
    try {
      observer->after_wait();
    } catch (...) {  // the wait's own error is the one to report
    }
    throw;
  }
  t_wait_observer = observer;
  observer->after_wait();
}

WaitObserverScope::WaitObserverScope(WaitObserver* observer)
    : previous_(std::exchange(t_wait_observer, observer)) {}

WaitObserverScope::~WaitObserverScope() {
  t_wait_observer = previous_;
}

namespace {
thread_local std::function<void()> t_interrupt_check;
}  // namespace

InterruptCheck::InterruptCheck(std::function<void()> check)
    : previous_(std::exchange(t_interrupt_check, std::move(check))) {}

InterruptCheck::~InterruptCheck() {
  t_interrupt_check = std::move(previous_);
}

std::function<void()> current_interrupt_check() {
  return t_interrupt_check;
}

void poll_interrupt_check() {
  if (t_interrupt_check) t_interrupt_check();
}

namespace {
struct DoneWork : Work::Impl {
  void wait() override {}
  bool completed() const override { return true; }
  std::optional<bool> test() const override { return true; }
};
}  // namespace

Work Work::done() {
  static const auto impl = std::make_shared<DoneWork>();
  return Work(impl);
}

std::optional<bool> test_all(const std::vector<Work>& works) {
  bool unknown = false;
  for (const auto& w : works) {
    const auto t = w.test();
    if (t.has_value() && !*t) return false;
    unknown = unknown || !t.has_value();
  }
  if (unknown) return std::nullopt;
  return true;
}

std::optional<bool> test_arrived(const std::vector<Work>& receives,
                                 const std::vector<Work>& sends) {
  const std::optional<bool> in = test_all(receives);
  if (in != true) return in;
  for (const auto& s : sends)
    if (s.test() == false) return false;
  return true;
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

std::vector<Work> Comm::batch(const std::vector<P2POp>& ops) {
  std::vector<Work> works;
  works.reserve(ops.size());
  for (const auto& op : ops)
    works.push_back(op.kind == P2POp::Kind::Send ? isend(op.tensor, op.peer)
                                                 : irecv(op.tensor, op.peer));
  return works;
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

namespace {

// dst = dst (op) src, in place.
void reduce_into(at::Tensor dst, const at::Tensor& src, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      dst.add_(src);
      break;
    case ReduceOp::Max:
      at::maximum_out(dst, dst, src);
      break;
    case ReduceOp::Min:
      at::minimum_out(dst, dst, src);
      break;
  }
}

void check_avg(ReduceOp op, const at::Tensor& t, const char* what) {
  TORCH_CHECK(op != ReduceOp::Avg || at::isFloatingType(t.scalar_type()), what,
              ": Avg needs a floating dtype, got ", t.scalar_type());
}

}  // namespace

// Ring reduce-scatter: at step s rank r sends its partial slice (r-s-1) to
// r+1 and adds the slice (r-s-2) received from r-1; after world-1 steps slice r
// holds the full reduction. Summation order is fixed, so results are
// deterministic run to run. Each step is one batch (a send to r+1, a receive
// from r-1), the same on every rank.
//
// NOTE [Gloo's reduce_scatter in LibTorch 2.x]
// LibTorch 1.13's ProcessGroupGloo had no flat reduce-scatter. LibTorch 2.6's
// has one (_reduce_scatter_base), and we still do not use it: it clones the
// whole input, all-reduces all of it and copies out this rank's slice - twice
// the bytes of this ring on every rank - and it drops the reduce op on the
// way (its AllreduceOptions are built and never passed), so Max and Min come
// back as sums. Checked on Debian 13's LibTorch 2.6: a Max reduce-scatter of
// {1,5,3,2} and {4,2,1,6} gives rank 0 {5,7}, not {4,5}; and an output of
// another dtype than the input is a fatal CHECK there (the process aborts,
// nothing to catch), where we throw.
void Comm::reduce_scatter(const at::Tensor& out, const at::Tensor& in, ReduceOp op) {
  detail::check_tensor(out, "reduce_scatter (output)");
  detail::check_tensor(in, "reduce_scatter (input)");
  const int n = world_size(), r = rank();
  const int64_t m = out.numel();
  TORCH_CHECK(in.numel() == m * n, "reduce_scatter: the input has ", in.numel(),
              " elements; it needs world_size (", n, ") x output numel (", m, ")");
  TORCH_CHECK(out.scalar_type() == in.scalar_type(), "reduce_scatter: output dtype ",
              out.scalar_type(), " differs from input dtype ", in.scalar_type());
  check_avg(op, in, "reduce_scatter");
  auto acc = in.reshape({-1}).clone();
  auto slice = [&](int i) { return acc.narrow(0, int64_t((i % n + n) % n) * m, m); };
  auto tmp = at::empty({m}, in.options());
  for (int s = 0; s < n - 1; ++s) {
    auto works =
        batch({P2POp::send(slice(r - s - 1), (r + 1) % n), P2POp::recv(tmp, (r - 1 + n) % n)});
    wait_all(works);
    reduce_into(slice(r - s - 2), tmp, op);
  }
  auto mine = slice(r);
  if (op == ReduceOp::Avg) mine.div_(n);
  out.view({-1}).copy_(mine);
}

namespace {

// A direct exchange in flight: every peer's part arrives in its own buffer;
// wait() waits for all of them, then `finish` combines them (in rank order).
struct ExchangeWork : Work::Impl {
  std::vector<Work> works;
  std::vector<at::Tensor> keep;  // sent tensors, alive until the wait
  std::function<void()> finish;
  void abort() override {
    for (auto& w : works)
      w.abort();
  }
  void wait() override {
    wait_all(works);
    keep.clear();
    if (finish) finish();
    finish = nullptr;
  }
  std::vector<bool> is_send;  // per work
  std::optional<bool> test() const override {
    std::vector<Work> sends, receives;
    for (size_t k = 0; k < works.size(); ++k)
      (k < is_send.size() && is_send[k] ? sends : receives).push_back(works[k]);
    return test_arrived(receives, sends);
  }
};

// Posts one batch: `send_to(q)` to every peer q, a receive into `recv_from(q)`
// from every peer, peers in rank order (the same on every rank).
template <typename SendTo, typename RecvInto>
std::shared_ptr<ExchangeWork> exchange(Comm& comm, SendTo send_to, RecvInto recv_into) {
  auto w = std::make_shared<ExchangeWork>();
  std::vector<P2POp> ops;
  for (int q = 0; q < comm.world_size(); ++q) {
    if (q == comm.rank()) continue;
    at::Tensor s = send_to(q);
    w->keep.push_back(s);
    ops.push_back(P2POp::send(s, q));
    ops.push_back(P2POp::recv(recv_into(q), q));
    w->is_send.insert(w->is_send.end(), {true, false});
  }
  w->works = comm.batch(ops);
  return w;
}

}  // namespace

Work Comm::all_gather_async(const at::Tensor& out, const at::Tensor& in_raw) {
  at::Tensor in = in_raw.contiguous();
  const int w = world_size(), me = rank();
  TORCH_CHECK(in.dim() >= 1 && out.dim() == in.dim() && out.size(0) == in.size(0) * w,
              "all_gather_async: the output's dim 0 (", out.dim() ? out.size(0) : 0,
              ") must be world_size (", w, ") x the input's (", in.dim() ? in.size(0) : 0, ")");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == in.scalar_type(),
              "all_gather_async: the output must be contiguous and of the input's dtype");
  const int64_t rows = in.size(0);
  out.narrow(0, me * rows, rows).copy_(in);
  return Work(exchange(
      *this, [&](int) { return in; }, [&](int q) { return out.narrow(0, q * rows, rows); }));
}

Work Comm::reduce_scatter_async(const at::Tensor& out, const at::Tensor& in_raw, ReduceOp op) {
  at::Tensor in = in_raw.contiguous();
  const int w = world_size(), me = rank();
  TORCH_CHECK(in.dim() >= 1 && in.size(0) % w == 0, "reduce_scatter_async: dim 0 (",
              in.dim() ? in.size(0) : 0, ") must divide by the world size ", w);
  const int64_t rows = in.size(0) / w;
  TORCH_CHECK(out.sizes() == in.narrow(0, 0, rows).sizes() && out.scalar_type() == in.scalar_type(),
              "reduce_scatter_async: the output must have the shape ",
              in.narrow(0, 0, rows).sizes(), " and the input's dtype");
  check_avg(op, in, "reduce_scatter_async");
  auto pieces = std::make_shared<std::vector<at::Tensor>>(w);
  (*pieces)[me] = in.narrow(0, me * rows, rows);
  auto work = exchange(
      *this, [&](int q) { return in.narrow(0, q * rows, rows); },
      [&](int q) { return (*pieces)[q] = at::empty_like((*pieces)[me]); });
  work->finish = [pieces, out, op, w] {
    at::Tensor acc = (*pieces)[0].clone();
    for (int q = 1; q < w; ++q)
      reduce_into(acc, (*pieces)[q], op);
    if (op == ReduceOp::Avg) acc.div_(w);
    out.copy_(acc);
  };
  return Work(work);
}

Work Comm::all_reduce_async(const at::Tensor& tensor, ReduceOp op) {
  TORCH_CHECK(tensor.is_contiguous(), "all_reduce_async: the tensor must be contiguous");
  check_avg(op, tensor, "all_reduce_async");
  const int w = world_size(), me = rank();
  auto pieces = std::make_shared<std::vector<at::Tensor>>(w);
  at::Tensor mine = tensor.clone();
  (*pieces)[me] = mine;
  auto work = exchange(
      *this, [&](int) { return mine; }, [&](int q) { return (*pieces)[q] = at::empty_like(mine); });
  work->finish = [pieces, tensor, op, w] {
    at::Tensor acc = (*pieces)[0].clone();
    for (int q = 1; q < w; ++q)
      reduce_into(acc, (*pieces)[q], op);
    if (op == ReduceOp::Avg) acc.div_(w);
    tensor.copy_(acc);
  };
  return Work(work);
}

Work Comm::all_to_all_async(const at::Tensor& out, const std::vector<int64_t>& out_rows,
                            const at::Tensor& in_raw, const std::vector<int64_t>& in_rows) {
  const int w = world_size(), me = rank();
  TORCH_CHECK(static_cast<int>(out_rows.size()) == w && static_cast<int>(in_rows.size()) == w,
              "all_to_all_async: give one row count per rank (", w, "), got ", in_rows.size(),
              " to send and ", out_rows.size(), " to receive");
  at::Tensor in = in_raw.contiguous();
  TORCH_CHECK(in.dim() >= 1 && out.dim() == in.dim() && out.is_contiguous() &&
                  out.scalar_type() == in.scalar_type() &&
                  out.sizes().slice(1) == in.sizes().slice(1),
              "all_to_all_async: the output must be contiguous, of the input's dtype and "
              "trailing shape; got ",
              out.sizes(), " ", out.scalar_type(), " for ", in.sizes(), " ", in.scalar_type());
  auto offsets = [&](const std::vector<int64_t>& rows, int64_t total, const char* what) {
    std::vector<int64_t> at(w + 1, 0);
    for (int q = 0; q < w; ++q) {
      TORCH_CHECK(rows[q] >= 0, "all_to_all_async: a negative row count ", rows[q]);
      at[q + 1] = at[q] + rows[q];
    }
    TORCH_CHECK(at[w] == total, "all_to_all_async: the ", what, " counts add up to ", at[w],
                " rows but the tensor has ", total);
    return at;
  };
  const auto in_at = offsets(in_rows, in.size(0), "send");
  const auto out_at = offsets(out_rows, out.size(0), "receive");
  TORCH_CHECK(in_rows[me] == out_rows[me], "all_to_all_async: this rank keeps ", in_rows[me],
              " of its own rows but expects ", out_rows[me]);
  if (in_rows[me] > 0)
    out.narrow(0, out_at[me], out_rows[me]).copy_(in.narrow(0, in_at[me], in_rows[me]));
  // The sends, then the receives, peers in rank order (NOTE [Sends before
  // receives] in hp/schedule/lower.cpp); a pair with nothing to move is left
  // out on both sides.
  auto work = std::make_shared<ExchangeWork>();
  std::vector<P2POp> ops;
  for (int q = 0; q < w; ++q) {
    if (q == me || in_rows[q] == 0) continue;
    at::Tensor s = in.narrow(0, in_at[q], in_rows[q]);
    work->keep.push_back(s);
    ops.push_back(P2POp::send(s, q));
  }
  work->is_send.assign(ops.size(), true);
  for (int q = 0; q < w; ++q)
    if (q != me && out_rows[q] > 0)
      ops.push_back(P2POp::recv(out.narrow(0, out_at[q], out_rows[q]), q));
  work->is_send.resize(ops.size(), false);
  if (!ops.empty()) work->works = batch(ops);
  return Work(work);
}

}  // namespace hp::distributed
