// The rank program of test_tp_mesh's process test: started 4 times by the
// launcher, it rendezvouses from the environment, trains its rank of the
// tp = 2 x dp = 2 case (tests/compile/tp_mesh_case.h) in graph mode and
// writes what it ends with to OUT_DIR/result_<rank>.pt (a pickled dict:
// "meta", "losses", "p:<fqn>" local tensors, "s:<fqn>" for FSDP shards).
//
//   tp_mesh_worker OUT_DIR
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstdio>
#include <exception>
#include <fstream>
#include <string>

#include "tests/compile/tp_mesh_case.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: tp_mesh_worker OUT_DIR\n");
    return 2;
  }
  int rank = -1;
  try {
    auto world = hp::distributed::Comm::from_env();
    rank = world->rank();
    hp_test::TpMeshCase c;
    const auto out = hp_test::run_tp_mesh_rank(c, world, "tp");
    c10::Dict<std::string, at::Tensor> dict;
    dict.insert("meta",
                torch::tensor({int64_t(out.tp_rank), int64_t(out.dp_rank), out.tp_copy_calls,
                               out.tp_reduce_calls, out.fsdp_degree, out.tp_size}));
    dict.insert("losses", torch::tensor(out.losses, torch::kFloat64));
    for (const auto& [name, t] : out.params)
      dict.insert("p:" + name, t);
    for (const auto& name : out.sharded)
      dict.insert("s:" + name, torch::ones({1}));
    const auto bytes = torch::jit::pickle_save(c10::IValue(dict));
    const std::string path = std::string(argv[1]) + "/result_" + std::to_string(rank) + ".pt";
    std::ofstream(path, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
    world->barrier();
    std::printf("tp_mesh_worker rank %d: done\n", rank);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tp_mesh_worker rank %d: %s\n", rank, e.what());
    return 1;
  }
}
