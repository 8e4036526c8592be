// Frames: messages that carry their own layout (NOTE [Messages that describe
// themselves]). Between two ranks every message travels as frames of one
// size both ends know; the first frame says what the message holds.
#pragma once

#include <torch/torch.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <vector>

#include "hp/distributed/comm.h"
#include "hp/pipeline/message.h"

namespace hp::pipeline {

// NOTE [Messages that describe themselves]
// Where no Layout is declared (ExecutorOptions::layout and activation_shape
// unset) the receiver cannot know a message's tensors when it posts its
// receive, long before the sender computed them; and between two ranks
// receives match sends in posting order, each of the exact size (no tags:
// NOTE [Point-to-point without tags]). So every message from rank a to rank
// b travels as frames of one size, `frame_bytes(a -> b)`, which both ends
// hold: the receiver posts one frame per RECV action, as early as a declared
// receive, and the sender sends as many frames as the message needs. Each
// frame opens with (magic, the message's number on that channel, the frame's
// index, the message's frame count); the first frame then holds the
// message's header (each tensor's dtype, shape, offset and whether it takes
// a gradient) and the tensors' bytes follow, 64-byte aligned. A message of
// one frame arrives into its frame and its tensors are views of it (no
// copy). A message that needs more frames takes the frames posted next (the
// ones meant for later messages), and whoever waits for a later message
// posts one more receive when none is left: frames are filed by their
// message's number, so any wait files what arrived, on either half of an
// overlapped pair. At the end of a step both ends set the channel's frame
// size to the largest message seen on it so far (rounded up to 64 bytes):
// each saw the same messages, so they agree without a word, and from then on
// a message of a size seen before is one frame again. A length never seen
// costs, in its first step, the frames beyond the first, received when the
// consumer waits. The sender copies the tensors into the frame (one copy of
// the message; declared layouts send the tensors themselves). On a device
// the receiver reads each first frame's header on the host: one host
// synchronization per received message, where declared layouts have none
// (NOTE [No host synchronization per action]).

/// The frames of one rank's messages to and from each peer, for one Executor.
class Frames {
 public:
  /// `first_frame_bytes`: every channel's frame size before any message was
  /// seen on it.
  Frames(int world, torch::Device device, int64_t first_frame_bytes);

  /// The sends of message `m` (which of its tensors take a gradient: their
  /// requires_grad(), or `grad` where given) to `peer`, the channel's next
  /// message. The returned ops' tensors stay valid while they are sent.
  std::vector<distributed::P2POp> send(const Message& m, const std::vector<bool>& grad, int peer);

  /// The receive of the next message from `peer` (one frame): returns the
  /// message's number; call `posted(peer, work)` with the op's Work after
  /// posting it, before anything else is expected from `peer`.
  distributed::P2POp expect(int peer, uint64_t* number);
  void posted(int peer, distributed::Work work);

  /// Message `number` from `peer`, once all its frames arrived; `grad` gets
  /// which tensors take a gradient. Waits for frames as needed, posting more
  /// receives with `post` (a one-op batch) when none is left. Thread-safe
  /// against another take (the halves of an overlapped pair).
  Message take(int peer, uint64_t number, std::vector<bool>* grad,
               const std::function<distributed::Work(const distributed::P2POp&)>& post);

  /// Ends a step: every expected message was taken, and each channel's frame
  /// size grows to its largest message so far.
  void end_step();
  /// Forgets a failed step's frames in flight (sizes learned stay).
  void abandon_step();

 private:
  struct Frame {
    torch::Tensor buffer;  // frame_bytes uint8
    distributed::Work work;
    bool has_work = false;
  };
  struct Assembly {
    int64_t count = -1;                      // frames of the message, once one arrived
    std::map<int64_t, torch::Tensor> parts;  // index -> frame
  };
  struct Channel {
    std::deque<Frame> posted;  // frames received into, in posting order
    std::map<uint64_t, Assembly> arrived;
    std::set<uint64_t> taken;    // messages handed out this step
    uint64_t next_expected = 0;  // the next message number a RECV gets
    int64_t waiting = 0;         // frames a take is waiting for now
    uint64_t filed = 0;          // frames filed so far (FiledWait watches it)
    int64_t largest = 0;         // largest message this step, in frame bytes
  };
  Message assemble(int peer, uint64_t number, Assembly& a, std::vector<bool>* grad);

  torch::Device device_;
  std::vector<int64_t> send_bytes_, recv_bytes_;
  std::vector<uint64_t> next_sent_;
  std::vector<int64_t> largest_sent_;
  std::vector<Channel> in_;
  std::mutex mutex_;
  std::condition_variable filed_cv_;
};

}  // namespace hp::pipeline
