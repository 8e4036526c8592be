// Messages between stages (NOTE [Messages between stages] in
// hp/pipeline/message.h): a stage hands the next a float64 activation, an
// int64 leaf of 2^40 + 1 and a bfloat16 activation; the pipeline's gradients
// and loss equal plain autograd's in one process, the int64 arrives exact, the
// leaf that takes no gradient travels forward only, and an output that
// differs from its declared layout is an error naming stage and leaf.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <filesystem>
#include <fstream>

#include "hp/distributed/comm.h"
#include "hp/models/models.h"
#include "hp/pipeline/pipeline.h"
#include "hp/schedule/generators.h"
#include "tests/common/forwarding_comm.h"
#include "tests/common/threads_as_ranks.h"
#include "tests/pipeline/tiny_train.h"

namespace {

using hp::distributed::Comm;
using hp::pipeline::Leaf;
using hp::pipeline::Message;

constexpr int64_t kBig = (int64_t{1} << 40) + 1;  // not a float32, nor a float64 sum's rounding

// Counts the tensors this rank sends, by dtype.
class SendCounter : public hp::testing::ForwardingComm {
 public:
  using ForwardingComm::ForwardingComm;
  std::vector<hp::distributed::Work> batch(
      const std::vector<hp::distributed::P2POp>& ops) override {
    for (const auto& op : ops)
      if (op.kind == hp::distributed::P2POp::Kind::Send) ++sent[op.tensor.scalar_type()];
    return ForwardingComm::batch(ops);
  }
  std::map<c10::ScalarType, int> sent;
};

struct Weights {
  torch::Tensor w, a, b;
};

// Ranks are threads: each draw has a generator of its own (the global one,
// seeded by two threads at once, once gave one rank the other's weights).
torch::Tensor draw(std::vector<int64_t> shape, uint64_t seed) {
  return torch::randn(shape, at::detail::createCPUGenerator(seed),
                      torch::TensorOptions().dtype(torch::kFloat64));
}

Weights weights_of(int chunk) {
  return {draw({4, 4}, 100 + chunk).requires_grad_(), draw({4}, 200 + chunk).requires_grad_(),
          draw({4}, 300 + chunk).requires_grad_()};
}

// Chunk c of `chunks`: [h f64, ids int64, s bf16] -> the same (the last: one
// tensor for the loss). It reads the ids as numbers: a lost low bit changes
// the result, and it checks them exactly.
Message chunk_forward(const Weights& p, int chunk, int chunks, const Message& in) {
  const torch::Tensor& h = in.at(0);
  const torch::Tensor& ids = in.at(1);
  const torch::Tensor& s = in.at(2);
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && s.scalar_type() == torch::kBFloat16, "chunk ",
              chunk, " got ", ids.scalar_type(), " and ", s.scalar_type());
  TORCH_CHECK(!ids.requires_grad(), "chunk ", chunk, ": the ids take no gradient");
  TORCH_CHECK(ids.min().item<int64_t>() >= kBig + chunk, "chunk ", chunk, ": ids arrived as ",
              ids.min().item<int64_t>(), ", not at least ", kBig + chunk);
  const torch::Tensor offset =
      (ids - (kBig - 1)).to(torch::kFloat64).unsqueeze(1);  // mb + chunk + 1
  torch::Tensor h2 = torch::tanh(h.matmul(p.w) + s.to(torch::kFloat64) * p.a) * offset / 4;
  if (chunk == chunks - 1) return {h2};
  torch::Tensor s2 = (h2 * p.b).to(torch::kBFloat16);
  return {h2, ids + 1, s2};
}

// Microbatches of 2, 3 and 4 rows: messages of three sizes.
int64_t rows(int mb) {
  return 2 + mb % 3;
}

Message input_of(int mb) {
  return {draw({rows(mb), 4}, 7 + mb),
          torch::full({rows(mb)}, kBig + 0, torch::kInt64) + torch::arange(rows(mb)) * mb,
          draw({rows(mb), 4}, 50 + mb).to(torch::kBFloat16)};
}

hp::pipeline::Layout layout_of_mb(int mb) {
  return {Leaf{torch::kFloat64, {rows(mb), 4}, true}, Leaf{torch::kInt64, {rows(mb)}, false},
          Leaf{torch::kBFloat16, {rows(mb), 4}, true}};
}

torch::Tensor loss_fn(const torch::Tensor& out, int) {
  return out.pow(2).sum();
}

struct Case {
  std::string schedule;
  int ranks, microbatches;
  bool overlap;
  std::string p2p = "group";
  /// No layout declared: the messages describe themselves, in frames of at
  /// first 256 bytes (smaller than a message: several frames each).
  bool described = false;
};

class MessagesOfSeveralTensors : public ::testing::TestWithParam<Case> {};

TEST_P(MessagesOfSeveralTensors, TrainLikeOneProcessExactly) {
  const Case c = GetParam();
  const auto sched = hp::schedule::build(c.schedule, c.ranks, c.microbatches);
  const int chunks = sched.num_stages;
  // The reference: every microbatch through every chunk in one process.
  std::vector<Weights> ref;
  for (int ch = 0; ch < chunks; ++ch)
    ref.push_back(weights_of(ch));
  double ref_loss = 0;
  for (int mb = 0; mb < c.microbatches; ++mb) {
    Message x = input_of(mb);
    for (int ch = 0; ch < chunks; ++ch)
      x = chunk_forward(ref[ch], ch, chunks, x);
    torch::Tensor loss = loss_fn(x[0], mb) / c.microbatches;
    loss.backward();
    ref_loss += loss.item<double>();
  }

  std::vector<std::map<int, Weights>> held(c.ranks);
  std::vector<std::map<c10::ScalarType, int>> sent(c.ranks);
  std::vector<double> losses(c.ranks), second_losses(c.ranks);
  std::vector<std::map<c10::ScalarType, int>> second_sent(c.ranks);
  hp::testing::run_ranks_as_threads(c.ranks, [&](int r, std::shared_ptr<Comm> world) {
    auto group = std::make_shared<SendCounter>(world);
    std::map<int, hp::pipeline::ChunkModule> modules;
    for (int st : sched.stages_of_rank(r)) {
      const int ch = sched.stage_chunk[st];
      Weights p = weights_of(ch);
      held[r][ch] = p;
      hp::pipeline::ChunkModule m;
      m.forward_message = [p, ch, chunks](const Message& in) {
        return chunk_forward(p, ch, chunks, in);
      };
      m.parameters = {p.w, p.a, p.b};
      modules[ch] = m;
    }
    hp::pipeline::PipelineOptions o;
    o.p2p = c.p2p;
    o.fb_overlap = c.overlap;
    o.input_message = input_of;
    if (c.described) {
      o.first_frame_bytes = 256;
    } else {
      o.layout = [](int, int mb) { return layout_of_mb(mb); };
    }
    hp::pipeline::Pipeline pipeline(sched, group, modules, loss_fn, o);
    losses[r] = pipeline.step().loss;
    sent[r] = group->sent;
    if (!c.described) return;
    // A second step: every channel's frames now hold its largest message,
    // so each message is one frame; the same gradients again.
    for (const auto& [ch, p] : held[r])
      for (auto t : {p.w, p.a, p.b})
        t.mutable_grad().zero_();
    group->sent.clear();
    second_losses[r] = pipeline.step().loss;
    second_sent[r] = group->sent;
  });
  for (int r = 0; r < c.ranks; ++r) {
    EXPECT_NEAR(losses[r], ref_loss, 1e-12 * ref_loss) << "rank " << r;
    if (c.described) {
      EXPECT_NEAR(second_losses[r], ref_loss, 1e-12 * ref_loss) << "rank " << r;
    }
  }
  for (int r = 0; r < c.ranks; ++r)
    for (const auto& [ch, p] : held[r]) {
      SCOPED_TRACE("rank " + std::to_string(r) + " chunk " + std::to_string(ch));
      const Weights& want = ref[ch];
      for (auto [got, w] : {std::make_pair(p.w, want.w), {p.a, want.a}, {p.b, want.b}}) {
        ASSERT_TRUE(got.grad().defined());
        // The bfloat16 leaf's gradient travels in bfloat16, as it does in
        // one process: the same numbers, up to the order of float64 sums.
        // (The last chunk does not use b: the pipeline gives it zeros.)
        const torch::Tensor want_grad = w.grad().defined() ? w.grad() : torch::zeros_like(w);
        EXPECT_LE((got.grad() - want_grad).abs().max().item<double>(),
                  1e-12 * std::max(1.0, want_grad.abs().max().item<double>()));
      }
    }
  // Every transfer between ranks: the ids (int64) travel forward only; the
  // float64 and bfloat16 leaves go forward and their gradients come back.
  // (Over the shared-memory rings the group sees none of them.)
  if (c.p2p != "group") return;
  int ids = 0, f64 = 0, bf16 = 0;
  for (const auto& s : sent) {
    ids += s.count(torch::kInt64) ? s.at(torch::kInt64) : 0;
    f64 += s.count(torch::kFloat64) ? s.at(torch::kFloat64) : 0;
    bf16 += s.count(torch::kBFloat16) ? s.at(torch::kBFloat16) : 0;
  }
  int forward_transfers = 0;  // route edges between ranks, over all microbatches
  for (int mb = 0; mb < c.microbatches; ++mb) {
    const auto& route = sched.routes.at(sched.microbatch_route.at(mb));
    for (size_t i = 0; i + 1 < route.size(); ++i)
      forward_transfers += sched.stage_rank[route[i]] != sched.stage_rank[route[i + 1]];
  }
  EXPECT_GT(forward_transfers, 0);
  if (c.described) {
    // Frames only; the first step's messages took several each, the
    // second's one each, forward and back.
    int first = 0, second = 0;
    for (int r = 0; r < c.ranks; ++r) {
      EXPECT_EQ(sent[r].size(), 1u);
      first += sent[r].count(torch::kUInt8) ? sent[r].at(torch::kUInt8) : 0;
      second += second_sent[r].count(torch::kUInt8) ? second_sent[r].at(torch::kUInt8) : 0;
    }
    EXPECT_GT(first, 2 * forward_transfers);
    EXPECT_EQ(second, 2 * forward_transfers);
    return;
  }
  EXPECT_EQ(ids, forward_transfers);
  EXPECT_EQ(f64, 2 * forward_transfers);
  EXPECT_EQ(bf16, 2 * forward_transfers);
}

INSTANTIATE_TEST_SUITE_P(Schedules, MessagesOfSeveralTensors,
                         ::testing::Values(Case{"1f1b", 2, 4, false},
                                           Case{"1f1b", 2, 4, false, "shm"},
                                           Case{"dualpipev", 2, 8, false},
                                           Case{"dualpipev", 2, 8, true},
                                           Case{"1f1b", 2, 4, false, "group", true},
                                           Case{"1f1b", 2, 4, false, "shm", true},
                                           Case{"dualpipev", 2, 8, true, "group", true}),
                         [](const auto& info) {
                           return info.param.schedule + (info.param.overlap ? "_overlap" : "") +
                                  "_" + info.param.p2p + (info.param.described ? "_described" : "");
                         });

// A stage whose output differs from its layout fails its step naming the
// stage, microbatch and first differing tensor; its peer fails too.
TEST(MessagesOfSeveralTensors, AnOutputUnlikeItsLayoutIsAnError) {
  const auto sched = hp::schedule::build("1f1b", 2, 2);
  std::vector<std::string> errors(2);
  hp::testing::run_ranks_as_threads(
      2,
      [&](int r, std::shared_ptr<Comm> group) {
        std::map<int, hp::pipeline::ChunkModule> modules;
        Weights p = weights_of(r);
        hp::pipeline::ChunkModule m;
        m.forward_message = [p, r](const Message& in) { return chunk_forward(p, r, 2, in); };
        m.parameters = {p.w, p.a, p.b};
        modules[r] = m;
        hp::pipeline::PipelineOptions o;
        o.p2p = "group";
        o.input_message = input_of;
        o.layout = [](int, int mb) {  // says the ids are int32
          auto l = layout_of_mb(mb);
          l[1].dtype = torch::kInt32;
          return l;
        };
        hp::pipeline::Pipeline pipeline(sched, group, modules, loss_fn, o);
        try {
          pipeline.step();
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      },
      std::chrono::seconds(20));
  EXPECT_NE(errors[0].find("stage 0 microbatch 0 output [Double [2, 4] grad, Long [2], "
                           "BFloat16 [2, 4] grad] where its layout says [Double [2, 4] grad, "
                           "Int [2], BFloat16 [2, 4] grad] (tensor 1 differs first)"),
            std::string::npos)
      << errors[0];
  EXPECT_FALSE(errors[1].empty()) << "the peer of the failed rank fails too";
}

// Ranks that disagree on how messages are laid out (declared on one,
// carried on the other) would misread each other's bytes: the Pipeline's
// agreement refuses them on both, before any transfer.
TEST(MessagesOfSeveralTensors, DeclaredOnOneRankCarriedOnAnotherIsRefused) {
  const auto sched = hp::schedule::build("1f1b", 2, 2);
  std::vector<std::string> errors(2);
  hp::testing::run_ranks_as_threads(2, [&](int r, std::shared_ptr<Comm> group) {
    std::map<int, hp::pipeline::ChunkModule> modules;
    Weights p = weights_of(r);
    hp::pipeline::ChunkModule m;
    m.forward_message = [p, r](const Message& in) { return chunk_forward(p, r, 2, in); };
    m.parameters = {p.w, p.a, p.b};
    modules[r] = m;
    hp::pipeline::PipelineOptions o;
    o.p2p = "group";
    o.input_message = input_of;
    if (r == 0) o.layout = [](int, int mb) { return layout_of_mb(mb); };
    try {
      hp::pipeline::Pipeline pipeline(sched, group, modules, loss_fn, o);
    } catch (const std::exception& e) {
      errors[r] = e.what();
    }
  });
  EXPECT_NE(errors[0].find("rank 0: rank 1's pipeline has messages that carry their layout "
                           "where this rank's are of a declared layout"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("rank 1: rank 0's pipeline has messages of a declared layout"),
            std::string::npos)
      << errors[1];
}

// The reference GPT with documents (NOTE [Documents in the reference GPT]):
// a token's logits do not depend on tokens of earlier lines, and the model
// cut into two chunks hands on [hidden, document numbers] and equals the
// whole model.
TEST(GptDocuments, ATokenSeesOnlyItsOwnLineAndTheCutModelEqualsTheWhole) {
  hp::models::ModelSpec spec;
  spec.dtype = torch::kFloat64;
  spec.layers = 2, spec.d_model = 16, spec.heads = 2, spec.seq_len = 8;
  spec.documents = true;
  auto whole = hp::models::build_chunk(spec, 0, 1, 3);
  auto first = hp::models::build_chunk(spec, 0, 2, 3),
       last = hp::models::build_chunk(spec, 1, 2, 3);
  auto tokens =
      torch::tensor(std::vector<int64_t>{'a', 'b', '\n', 'c', 'd', 'e', '\n', 'f'}).view({1, 8});
  EXPECT_TRUE(hp::models::document_numbers(tokens).equal(
      torch::tensor(std::vector<int64_t>{0, 0, 0, 1, 1, 1, 1, 2}).view({1, 8})));
  auto other = tokens.clone();
  other[0][0] = int64_t('x'), other[0][1] = int64_t('y');  // the first line only
  torch::NoGradGuard no_grad;
  auto a = whole->forward(tokens), b = whole->forward(other);
  EXPECT_TRUE(a.narrow(1, 3, 5).equal(b.narrow(1, 3, 5))) << "a later line saw the first";
  EXPECT_FALSE(a.narrow(1, 0, 3).equal(b.narrow(1, 0, 3)));
  hp::models::ModelSpec plain = spec;
  plain.documents = false;
  auto c = hp::models::build_chunk(plain, 0, 1, 3);
  EXPECT_FALSE(c->forward(tokens).narrow(1, 3, 5).equal(c->forward(other).narrow(1, 3, 5)))
      << "without documents every token sees the whole row";
  // Cut in two: a message of two tensors between the chunks.
  auto message = first->forward_message({tokens});
  ASSERT_EQ(message.size(), 2u);
  EXPECT_EQ(message[1].scalar_type(), torch::kLong);
  EXPECT_TRUE(message[1].equal(hp::models::document_numbers(tokens)));
  auto out = last->forward_message(message);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_LE((out[0] - a).abs().max().item<double>(), 1e-12);
  try {
    last->forward(message[0]);
    ADD_FAILURE() << "a later chunk ran without its document numbers";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("call forward_message"), std::string::npos) << e.what();
  }
}

// `hp train --documents`: the stages hand on a message of two tensors (the
// int64 numbers forward only), and the pipeline trains as one process on
// every kind of schedule (split backward, V, replicas, overlapped pairs,
// recompute). The text has a newline every few bytes, so the mask is at work
// (the reference without documents trains otherwise).
TEST(GptDocuments, HpTrainHandsOnTheDocumentsAndTrainsAsOneProcess) {
  const auto text = std::filesystem::temp_directory_path() /
                    ("hp-documents-" + std::to_string(::getpid()) + ".txt");
  {
    std::ofstream out(text);
    for (int i = 0; i < 400; ++i)
      out << "line " << i * 7919 % 1000 << (i % 3 ? " of text" : "") << "\n";
  }
  struct Run {
    std::string schedule;
    int m;
    bool overlap, recompute;
  };
  for (const Run& run :
       {Run{"1f1b", 4, false, false}, Run{"zbv", 4, false, true}, Run{"dualpipev", 6, true, false},
        Run{"interleaved-zb", 4, false, false}}) {
    SCOPED_TRACE(run.schedule);
    hp::train::TrainConfig c = hp::testing::tiny(run.schedule, 2, run.m, "gpt");
    c.model.documents = true;
    c.data = text.string();
    c.fb_overlap = run.overlap;
    c.recompute = run.recompute;
    const hp::train::TrainResult ref = hp::train::train_reference(c);
    hp::testing::expect_copies_equal_the_reference(hp::testing::run_threads(c), ref);
    hp::train::TrainConfig plain = c;
    plain.model.documents = false;
    EXPECT_GT(std::abs(hp::train::train_reference(plain).losses.back() - ref.losses.back()), 1e-6);
  }
  std::filesystem::remove(text);
}

}  // namespace
