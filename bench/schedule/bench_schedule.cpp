// bench/schedule/bench_schedule.cpp: speed of the schedule room: building
// zb-auto and the cost-aware zbv-auto at p=32, m=256 (bar: < 1 s) and simulating
// schedules at p=64, m=512 (bar: < 100 ms each).
#include <benchmark/benchmark.h>

#include "hp/schedule/generators.h"
#include "hp/schedule/lower.h"
#include "hp/schedule/simulate.h"

namespace {
namespace hs = hp::schedule;

void BM_ZbAuto(benchmark::State& state) {
  const int p = static_cast<int>(state.range(0)), m = static_cast<int>(state.range(1));
  hs::BuildOptions o;
  o.costs.comm = 0.1;
  for (auto _ : state) {
    hs::Schedule s = hs::build("zb-auto", p, m, o);
    benchmark::DoNotOptimize(s.actions.data());
  }
}
BENCHMARK(BM_ZbAuto)->Args({8, 64})->Args({32, 256})->Unit(benchmark::kMillisecond);

void BM_ZbvAuto(benchmark::State& state) {
  const int p = static_cast<int>(state.range(0)), m = static_cast<int>(state.range(1));
  hs::BuildOptions o;
  o.costs.comm = 0.1;
  for (auto _ : state) {
    hs::Schedule s = hs::build("zbv-auto", p, m, o);
    benchmark::DoNotOptimize(s.actions.data());
  }
}
BENCHMARK(BM_ZbvAuto)->Args({8, 64})->Args({32, 256})->Unit(benchmark::kMillisecond);

void BM_Simulate(benchmark::State& state, const char* name) {
  const int p = 64, m = 512;
  hs::Schedule s = hs::build(name, p, m);
  hs::CostModel c;
  c.comm = 0.1;
  for (auto _ : state) {
    hs::SimResult r = hs::simulate(s, c);
    benchmark::DoNotOptimize(r.makespan);
  }
  state.counters["actions"] = static_cast<double>(s.actions[0].size()) * p;
}
BENCHMARK_CAPTURE(BM_Simulate, gpipe, "gpipe")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Simulate, 1f1b, "1f1b")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Simulate, interleaved_1f1b, "interleaved-1f1b")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Simulate, zb_h1, "zb-h1")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Simulate, zb_h2, "zb-h2")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Simulate, zbv, "zbv")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Simulate, dualpipe, "dualpipe")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Simulate, dualpipev, "dualpipev")->Unit(benchmark::kMillisecond);

void BM_LowerValidate(benchmark::State& state) {
  hs::Schedule s = hs::build("1f1b", 64, 512);
  for (auto _ : state) {
    hs::Schedule l = hs::lower(s);
    hs::validate(l);
    benchmark::DoNotOptimize(l.actions.data());
  }
}
BENCHMARK(BM_LowerValidate)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
