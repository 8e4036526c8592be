// TrainConfig and TrainResult: everything `hp train` can be told, its
// checks, and what a run reports. Every room of hp/train reads these; none
// of them needs the training loop (trainer.h).
#pragma once

#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "hp/models/models.h"
#include "hp/schedule/schedule.h"
#include "hp/schedule/simulate.h"
#include "hp/schedule/timeline.h"

namespace hp::train {

/// Everything `hp train` can be told.
struct TrainConfig {
  models::ModelSpec model;
  int nproc = 2;  ///< pipeline ranks (--pp; -p/--nproc)
  /// Copies of the pipeline, data parallel (--dp): nproc x dp processes on
  /// a (dp, pp) mesh; each copy trains on its own microbatches and the
  /// stages' gradients are averaged over the copies (NOTE [Pipeline x data
  /// parallel] in trainer.cpp).
  int dp = 1;
  /// With --dp: each stage's parameters, gradients and optimizer state
  /// sharded over the copies between steps, whole during a step (NOTE [PP x
  /// FSDP in hp train] in hp/train/fsdp.h).
  bool fsdp = false;
  /// --model moe: the experts spread over this many ranks (--ep), groups of
  /// consecutive data-parallel copies: ep > 1 needs dp a multiple of ep
  /// (NOTE [Expert gradients] in hp/pipeline/pipeline.cpp).
  int ep = 1;
  std::string schedule = "1f1b";  ///< any hp/schedule generator name
  /// A schedule CSV to run instead of a generator (`hp schedule recommend -o`,
  /// `hp schedule show --csv`); its ranks and microbatches must be nproc and
  /// microbatches.
  std::string schedule_file;
  int chunks = 2;               ///< virtual stages per rank (interleaved schedules)
  int microbatches = 4;         ///< per step
  int64_t microbatch_size = 4;  ///< rows (sequences or samples) per microbatch
  int steps = 10;
  std::string optimizer = "adamw";  ///< adamw or sgd
  double lr = 1e-3;
  double weight_decay = 0.0;
  uint64_t seed = 0;
  std::string data;            ///< text file or folder; empty = Debian's license texts
  std::string trace;           ///< write the executed timeline (.json trace and .svg)
  std::string report;          ///< write the JSON report here
  std::string checkpoint_dir;  ///< where --save-every and --resume keep checkpoints
  int save_every = 0;          ///< 0 = never
  /// Continue from the newest verified checkpoint; none is an error
  /// (NOTE [Checkpoint integrity] in hp/train/checkpoint.h).
  bool resume = false;
  /// As `resume`, but a folder without any checkpoint starts from step 0.
  bool resume_or_start = false;
  /// The verified checkpoint step to start from, chosen (under the folder's
  /// lock) by whoever started the ranks; -1: the ranks choose (and rank 0
  /// locks the folder).
  int checkpoint_step = -1;
  bool recompute = false;  ///< checkpoint every transformer block
  /// Where each rank computes: "cpu", "cuda" (rank with local rank r on GPU
  /// r mod the GPU count; ranks that share a GPU exchange through host
  /// memory) or "auto" (cuda when there is a GPU). NOTE [Ranks on devices].
  std::string device = "cpu";
  int timeout_s = 60;  ///< every communication's timeout
  /// Point-to-point between the pipeline's ranks of one host: "group" (the
  /// group's own, loopback TCP over Gloo), "shm" (shared-memory rings; an error where they
  /// cannot be made) or "auto" (the rings where every rank can have them,
  /// else Gloo's, with a note on stderr). NOTE [Choosing the point-to-point]
  /// in hp/distributed/shm_p2p.cpp.
  std::string p2p = "auto";
  /// Receives posted this many batches ahead (over Gloo or the rings, not
  /// NCCL; NOTE [Receives posted ahead] in hp/pipeline/executor.cpp).
  int receive_lookahead = 0;
  /// Each FB pair's forward and backward overlapped (PipelineOptions::fb_overlap).
  bool fb_overlap = false;
  /// With fb_overlap: each pair's W waits for a wait to fill (PipelineOptions::defer_wgrad).
  bool defer_wgrad = false;
  /// With fb_overlap and not defer_wgrad: the run turns defer_wgrad on after
  /// its second step where the simulator predicts a shorter step with it
  /// (`--defer-wgrad auto`, the default; NOTE [The deferred W's chosen in
  /// the run] in hp/pipeline/pipeline.cpp). False: `--defer-wgrad off`.
  bool defer_wgrad_auto = true;
  /// With defer_wgrad_auto: the share by which deferred W's must shorten the
  /// predicted step to be chosen (1: never; below 0: up to that share longer).
  double defer_wgrad_gain = schedule::kDeferredWGain;
  /// With fb_overlap: "ready" (a half takes the CPU as its message arrives;
  /// the expert- and data-parallel groups in lanes; CPU ranks; not with
  /// defer_wgrad and recompute together), "fixed" (the code's order) or
  /// "auto" (ready without defer_wgrad, else fixed). NOTE [Turns as
  /// messages arrive] in hp/pipeline/overlap.cpp.
  std::string pair_turns = "auto";
  /// With defer_wgrad and ready turns, > 1: each deferred W in this many
  /// parts (PipelineOptions::deferred_w_parts); 1: whole.
  int w_parts = 1;
  /// "LATENCY_US,GBPS": the cost every pipeline transfer and expert all-to-all
  /// pays (NOTE [The link model] in hp/distributed/link_model.cpp); empty: none.
  std::string link;
  bool progress = true;  ///< progress bar on rank 0
  /// Graph mode (hp/compile): data parallel over the ranks with FSDP, the
  /// train step captured once and replayed; schedule and chunks do not apply.
  bool graph = false;
  bool overlap = true;  ///< graph mode: AutoOverlapPass (waits moved to first use)
  bool shard = true;    ///< graph mode: FSDP-shard parameters (off: plain data parallel)

  /// Checks everything that can be checked before a rank starts (ranges,
  /// finite learning rate, the data, the output paths, the size of the
  /// schedule, then the schedule itself); throws std::invalid_argument saying
  /// what to change and, for a limit, why it is there.
  void validate() const;
  /// Refuses a run whose ranks on this machine (`local_ranks` of the
  /// `nproc`) cannot fit in its available memory: each rank's start-up
  /// memory plus its share of the parameters, gradients, optimizer state and
  /// one microbatch's activations, a lower bound. Throws
  /// std::invalid_argument with the estimate and what is available.
  void check_memory(int local_ranks) const;
  /// The lowered, validated schedule this config runs (its size checked
  /// before it is built and lowered).
  schedule::Schedule build_schedule() const;
  /// The device of the rank whose local rank is `local_rank` (NOTE [Ranks on
  /// devices]); throws std::invalid_argument when `device` asks for CUDA and
  /// there is no CUDA device.
  torch::Device resolve_device(int local_rank) const;
  /// With fb_overlap: whether the pairs take their turns as messages arrive
  /// (CPU ranks, pair_turns "ready", or "auto" without defer_wgrad; NOTE
  /// [Turns as messages arrive]).
  bool pairs_take_ready_turns() const;
};

/// What `--defer-wgrad auto` chose (NOTE [The deferred W's chosen in the run]).
struct DeferredWInRun {
  bool decided = false;  ///< false: auto was off, the run had fewer than 3 steps, or no FB pairs
  int after_step = 0;    ///< the (1-based) step whose costs decided
  schedule::DeferredWChoice choice;
};

/// What one rank (or the reference) did.
struct TrainResult {
  DeferredWInRun deferred_w_in_run;
  std::vector<double> losses;        ///< per step (mean over microbatches)
  std::vector<double> step_seconds;  ///< per step wall time
  int first_step = 0;                ///< > 0 after --resume
  /// Final parameters by model-wide name (only the ones this rank holds).
  std::map<std::string, torch::Tensor> parameters;
  double checksum = 0.0;  ///< sum over all parameters (each name once) of sum(p)
  /// Per-rank measurements gathered on rank 0 (empty elsewhere).
  std::vector<double> rank_compute, rank_comm_wait, rank_overhead, rank_peak_bytes;
  /// Per rank, StepStats::chunk_wait: waits inside the chunks (expert
  /// all-to-alls) with nothing else to compute.
  std::vector<double> rank_chunk_wait;
  /// Per rank with --dp: its last step's compute, and its pairs' hidden and
  /// exposed communication, on each copy in the copies' order (NOTE [The
  /// copies' compute] in report.cpp).
  std::vector<std::vector<double>> rank_copies_compute, rank_copies_pair_hidden,
      rank_copies_pair_exposed;
  /// Per rank, the last step's overlapped pairs (StepStats::pair_hidden and
  /// pair_exposed): communication hidden and exposed, in seconds.
  std::vector<double> rank_pair_hidden, rank_pair_exposed;
  /// Of rank_pair_exposed, the seconds after the pair's other half ended
  /// (PairStats::exposed_alone).
  std::vector<double> rank_pair_exposed_alone;
  /// Per rank, the simulator's hidden and exposed seconds of those pairs
  /// under the fitted costs (NOTE [What a pair hides, predicted]).
  std::vector<double> rank_predicted_pair_hidden, rank_predicted_pair_exposed;
  /// Per rank, with defer_wgrad: the last step's W's that ran in a pair's
  /// waits, and those left for the step's end (StepStats).
  std::vector<int> rank_deferred_w_in_waits, rank_deferred_w_at_end;
  double measured_bubble = 0.0;     ///< bubble rate of the measured timeline (last step)
  double simulated_bubble = 0.0;    ///< simulator's bubble rate from measured F/I/W costs
  double simulated_makespan = 0.0;  ///< simulator's step time (s) from the same costs
  double measured_makespan = 0.0;   ///< last step's measured timeline length (s)
  /// Per rank (rank 0 only; empty on a device, where the CPU tracker counts
  /// nothing): the simulator's peak activation bytes under the stage bytes
  /// measured before the first step, and one microbatch's activations there
  /// (the sum of its stages' mem_b): NOTE [Memory measured against predicted].
  std::vector<double> rank_predicted_peak_bytes, rank_microbatch_bytes;
  /// The same count with each op's measured transient on top (same NOTE).
  std::vector<double> rank_predicted_peak_transient_bytes;
  /// Per-stage F, I, W (seconds per microbatch) measured from the last step's
  /// timeline and the measured transfer latency: the report's "stage_costs",
  /// which `hp schedule recommend --costs` reads (NOTE [Stage cost file]).
  schedule::CostModel stage_costs;
  schedule::Timeline timeline;  ///< executed timeline of the last step (rank 0: all ranks)
  std::vector<schedule::Action> executed;  ///< this rank's compute actions, last step, in run order
  int64_t items_per_step = 0;              ///< tokens (gpt) or samples (mlp) per step
  /// The pipeline group's backend on this rank: "gloo+shm" where its
  /// point-to-point went to shared-memory rings, else "gloo" (or "nccl").
  std::string p2p_backend;
  std::string p2p_note;  ///< why --p2p auto used the group's point-to-point ("" if it did not)
  // Graph mode only (rank 0 holds the per-rank lists):
  std::vector<double> rank_param_bytes;  ///< parameter bytes each rank holds (FSDP: shards)
  std::vector<double> rank_hidden_comm;  ///< share of collective time overlapped with compute
  std::vector<std::string> sharded;      ///< FQNs FSDP sharded
  double compile_seconds = 0.0;          ///< capture + passes
};

}  // namespace hp::train
