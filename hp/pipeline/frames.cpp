// Frames: a message's tensors and header packed into frames of its channel's
// size, and frames filed back into messages (NOTE [Messages that describe
// themselves] in frames.h).
#include "hp/pipeline/frames.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

namespace hp::pipeline {
namespace {

constexpr int64_t kMagic = 0x68706672616d6531;  // "hpframe1"
constexpr int64_t kFrameHeader = 4 * 8;         // magic, number, index, count
constexpr int64_t kAlign = 64;

int64_t align(int64_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}

// Copies `values` into the first bytes of `bytes` (a uint8 tensor anywhere).
void write_ints(const torch::Tensor& bytes, const std::vector<int64_t>& values) {
  torch::Tensor host = torch::from_blob(const_cast<int64_t*>(values.data()),
                                        {int64_t(values.size())}, torch::kInt64);
  bytes.narrow(0, 0, int64_t(values.size()) * 8).view(torch::kInt64).copy_(host);
}

// The first `n` int64 of `bytes`, on the host.
std::vector<int64_t> read_ints(const torch::Tensor& bytes, int64_t n) {
  torch::Tensor t = bytes.narrow(0, 0, n * 8).view(torch::kInt64).to(torch::kCPU);
  const int64_t* p = t.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + n);
}

// A wait for another thread's frame to be filed, as a Work, so that an
// overlapped pair's baton passes while it waits (NOTE [Overlapped pairs]).
struct FiledWait : distributed::Work::Impl {
  std::mutex& mutex;
  std::condition_variable& cv;
  const uint64_t& filed;
  uint64_t seen;
  FiledWait(std::mutex& m, std::condition_variable& c, const uint64_t& f)
      : mutex(m), cv(c), filed(f), seen(f) {}
  void wait() override {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return filed != seen; });
  }
  std::optional<bool> test() const override {
    std::lock_guard<std::mutex> lock(mutex);
    return filed != seen;
  }
};

}  // namespace

Frames::Frames(int world, torch::Device device, int64_t first_frame_bytes)
    : device_(device),
      send_bytes_(world, align(first_frame_bytes)),
      recv_bytes_(world, align(first_frame_bytes)),
      next_sent_(world, 0),
      largest_sent_(world, 0),
      in_(world) {
  TORCH_CHECK(first_frame_bytes >= 2 * kAlign, "a frame holds at least ", 2 * kAlign,
              " bytes, not ", first_frame_bytes);
}

std::vector<distributed::P2POp> Frames::send(const Message& m, const std::vector<bool>& grad,
                                             int peer) {
  // The header: count, header bytes, payload bytes; per tensor: dtype,
  // takes a gradient, dims, offset, bytes, then its sizes.
  std::vector<int64_t> h = {int64_t(m.size()), 0, 0};
  for (const torch::Tensor& t : m)
    h.resize(h.size() + 5 + size_t(t.dim()));
  const int64_t header_bytes = align(int64_t(h.size()) * 8);
  int64_t off = header_bytes;
  size_t k = 3;
  for (size_t i = 0; i < m.size(); ++i) {
    const torch::Tensor& t = m[i];
    const int64_t nbytes = t.numel() * int64_t(t.element_size());
    h[k++] = int64_t(t.scalar_type());
    h[k++] = grad.empty() ? t.requires_grad() : bool(grad[i]);
    h[k++] = t.dim();
    h[k++] = off;
    h[k++] = nbytes;
    for (int64_t d : t.sizes())
      h[k++] = d;
    off = align(off + nbytes);
  }
  const int64_t total = off;
  h[1] = header_bytes;
  h[2] = total;

  const int64_t frame = send_bytes_.at(peer), data = frame - kFrameHeader;
  const int64_t count = std::max<int64_t>(1, (total + data - 1) / data);
  const auto bytes = torch::TensorOptions().dtype(torch::kUInt8).device(device_);
  torch::Tensor frames = torch::empty({count * frame}, bytes);
  torch::Tensor payload =
      count == 1 ? frames.narrow(0, kFrameHeader, data) : torch::empty({count * data}, bytes);
  write_ints(payload, h);
  {
    torch::NoGradGuard no_grad;
    k = 3;
    for (const torch::Tensor& t : m) {
      const int64_t at = h[k + 3], nbytes = h[k + 4];
      k += 5 + size_t(t.dim());
      if (nbytes == 0) continue;
      payload.narrow(0, at, nbytes).view(t.scalar_type()).view(t.sizes()).copy_(t.detach());
    }
  }
  if (count > 1)
    frames.view({count, frame}).narrow(1, kFrameHeader, data).copy_(payload.view({count, data}));
  const uint64_t number = next_sent_.at(peer)++;
  std::vector<distributed::P2POp> ops;
  for (int64_t i = 0; i < count; ++i) {
    torch::Tensor f = frames.narrow(0, i * frame, frame);
    write_ints(f, {kMagic, int64_t(number), i, count});
    ops.push_back(distributed::P2POp::send(f, peer));
  }
  largest_sent_.at(peer) = std::max(largest_sent_.at(peer), align(kFrameHeader + total));
  return ops;
}

distributed::P2POp Frames::expect(int peer, uint64_t* number) {
  std::lock_guard<std::mutex> lock(mutex_);
  Channel& ch = in_.at(peer);
  torch::Tensor buffer = torch::empty({recv_bytes_.at(peer)},
                                      torch::TensorOptions().dtype(torch::kUInt8).device(device_));
  ch.posted.push_back({buffer, {}, false});
  *number = ch.next_expected++;
  return distributed::P2POp::recv(buffer, peer);
}

void Frames::posted(int peer, distributed::Work work) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (Frame& f : in_.at(peer).posted)
    if (!f.has_work) {
      f.work = std::move(work);
      f.has_work = true;
      return;
    }
  TORCH_INTERNAL_ASSERT(false, "Frames::posted without a frame expected from rank ", peer);
}

Message Frames::take(int peer, uint64_t number, std::vector<bool>* grad,
                     const std::function<distributed::Work(const distributed::P2POp&)>& post) {
  std::unique_lock<std::mutex> lock(mutex_);
  Channel& ch = in_.at(peer);
  TORCH_CHECK(number < ch.next_expected, "message ", number, " from rank ", peer,
              " was never expected");
  while (true) {
    auto it = ch.arrived.find(number);
    if (it != ch.arrived.end() && it->second.count >= 0 &&
        int64_t(it->second.parts.size()) == it->second.count) {
      Assembly a = std::move(it->second);
      ch.arrived.erase(it);
      lock.unlock();
      return assemble(peer, number, a, grad);
    }
    // Frames still to come, at least: each expected message's missing ones.
    int64_t needed = 0;
    for (uint64_t n = 0; n < ch.next_expected; ++n) {
      auto a = ch.arrived.find(n);
      if (a == ch.arrived.end()) {
        needed += ch.taken.count(n) ? 0 : 1;
      } else {
        needed += a->second.count - int64_t(a->second.parts.size());
      }
    }
    Frame f;
    if (!ch.posted.empty()) {
      f = std::move(ch.posted.front());
      ch.posted.pop_front();
      TORCH_INTERNAL_ASSERT(f.has_work, "a frame from rank ", peer, " was never posted");
    } else if (needed > ch.waiting) {
      // More frames are on their way than receives are posted: one more.
      f.buffer = torch::empty({recv_bytes_.at(peer)},
                              torch::TensorOptions().dtype(torch::kUInt8).device(device_));
      lock.unlock();
      f.work = post(distributed::P2POp::recv(f.buffer, peer));
      lock.lock();
    } else {
      // The frames on their way are all being waited for by the other half
      // of a pair: wait until it files one.
      distributed::Work filed(std::make_shared<FiledWait>(mutex_, filed_cv_, ch.filed));
      lock.unlock();
      filed.wait();
      lock.lock();
      continue;
    }
    ++ch.waiting;
    lock.unlock();
    try {
      f.work.wait();
    } catch (...) {
      lock.lock();
      --ch.waiting;
      throw;
    }
    const std::vector<int64_t> fh = read_ints(f.buffer, 4);
    lock.lock();
    --ch.waiting;
    TORCH_CHECK(fh[0] == kMagic, "a frame from rank ", peer,
                " is not a message frame: the ranks disagree on what they send");
    Assembly& a = ch.arrived[uint64_t(fh[1])];
    a.count = fh[3];
    a.parts[fh[2]] = f.buffer;
    ++ch.filed;
    filed_cv_.notify_all();
  }
}

Message Frames::assemble(int peer, uint64_t number, Assembly& a, std::vector<bool>* grad) {
  const int64_t frame = a.parts.at(0).numel(), data = frame - kFrameHeader;
  torch::Tensor payload;
  if (a.count == 1) {
    payload = a.parts.at(0).narrow(0, kFrameHeader, data);
  } else {
    std::vector<torch::Tensor> parts;
    for (int64_t i = 0; i < a.count; ++i)
      parts.push_back(a.parts.at(i).narrow(0, kFrameHeader, data));
    payload = torch::cat(parts);
  }
  const std::vector<int64_t> head = read_ints(payload, 3);
  const std::vector<int64_t> h = read_ints(payload, head[1] / 8);
  const int64_t total = head[2];
  Message m;
  std::vector<bool> takes;
  size_t k = 3;
  for (int64_t i = 0; i < head[0]; ++i) {
    const auto dtype = static_cast<c10::ScalarType>(h[k]);
    takes.push_back(h[k + 1] != 0);
    const int64_t dims = h[k + 2], at = h[k + 3], nbytes = h[k + 4];
    std::vector<int64_t> shape(h.begin() + int64_t(k) + 5, h.begin() + int64_t(k) + 5 + dims);
    k += 5 + size_t(dims);
    m.push_back(payload.narrow(0, at, nbytes).view(dtype).view(shape));
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Channel& ch = in_.at(peer);
    ch.largest = std::max(ch.largest, align(kFrameHeader + total));
    ch.taken.insert(number);
  }
  if (grad != nullptr) *grad = std::move(takes);
  return m;
}

void Frames::end_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t p = 0; p < in_.size(); ++p) {
    Channel& ch = in_[p];
    TORCH_CHECK(ch.posted.empty() && ch.arrived.empty() && ch.taken.size() == ch.next_expected,
                "the step ended with ", ch.next_expected - ch.taken.size(), " messages from rank ",
                p, " never taken and ", ch.posted.size(), " frames unread");
    recv_bytes_[p] = std::max(recv_bytes_[p], ch.largest);
    ch = Channel{};
    send_bytes_[p] = std::max(send_bytes_[p], largest_sent_[p]);
    largest_sent_[p] = 0;
    next_sent_[p] = 0;
  }
}

void Frames::abandon_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t p = 0; p < in_.size(); ++p) {
    in_[p] = Channel{};
    largest_sent_[p] = 0;
    next_sent_[p] = 0;
  }
}

}  // namespace hp::pipeline
