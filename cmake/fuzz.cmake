# hp_libfuzzer(TARGET name SUITE suite CORPUS dir SOURCES src... [LIBS lib...]
#              [DEPENDS header...])
#
# A libFuzzer binary of SOURCES (a fuzz target plus the torch-free sources it
# parses with), built with this build's compiler when it is clang, else with
# a clang++ found on the machine; and the ctest test <suite>.LibFuzzerSeeded
# that runs it bounded: 20000 inputs mutated from CORPUS with a fixed seed,
# at most 60 s; a crash or a hang (30 s) fails the test and leaves the input
# as crash-* or timeout-* in the build folder (add it to CORPUS once fixed).
# Fuzzing for longer, by hand: drop -seed and -runs.
# NOTE [A fuzz run is not repeatable]: the seed does not make the inputs
# repeat. libFuzzer also learns from the values its comparisons see,
# pointers among them, and ASLR moves those, so each run tries inputs of its
# own: a CI run met a yaml-cpp loop that runs before had not (NOTE [yaml-cpp
# loops on a stray comma]). The memory limit is on each allocation
# (-malloc_limit_mb), not on the process (-rss_limit_mb=0): at the RSS limit
# libFuzzer first prints a heap profile, which under ASan outlasted ctest's
# 120 s on that loop (grown to 2 GiB) and saved no input; a loop that grows
# now ends at -timeout, its input saved.
# NOTE [A hang is 30 s of wall clock]: libFuzzer's -timeout is an alarm on
# the wall clock, and the shared test host can stop a process for seconds:
# one CI run failed with -timeout=10 on an input that runs in 60 ms alone
# (yaml-cpp inside LoadAll, 6 s into a run whose 20000 inputs take 10 s).
# The hangs this catches (yaml-cpp's loops, NOTE [yaml-cpp loops on a stray
# comma]) never return, so 30 s finds them as surely.
# Without clang a warning says the corpus replay in the room's gtest
# executable is what remains.
function(hp_libfuzzer)
  cmake_parse_arguments(F "" "TARGET;SUITE;CORPUS" "SOURCES;LIBS;DEPENDS" ${ARGN})
  set(flags -fsanitize=fuzzer,address,undefined)
  if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    add_executable(${F_TARGET} ${F_SOURCES})
    target_include_directories(${F_TARGET} PRIVATE ${PROJECT_SOURCE_DIR})
    target_compile_options(${F_TARGET} PRIVATE ${flags})
    target_link_options(${F_TARGET} PRIVATE ${flags})
    target_link_libraries(${F_TARGET} PRIVATE ${F_LIBS})
    set(fuzzer $<TARGET_FILE:${F_TARGET}>)
  else()
    find_program(HP_CLANGXX NAMES clang++ clang++-19 clang++-16 clang++-14)
    if(NOT HP_CLANGXX)
      message(WARNING "no clang++: ${F_SUITE}.LibFuzzerSeeded is not built; the kept corpus "
                      "still runs in the room's tests (install clang, as "
                      "scripts/install_deps.sh does)")
      return()
    endif()
    set(fuzzer ${CMAKE_CURRENT_BINARY_DIR}/${F_TARGET}_clang)
    set(libs)
    foreach(lib ${F_LIBS})
      list(APPEND libs -l${lib})
    endforeach()
    add_custom_command(
      OUTPUT ${fuzzer}
      COMMAND ${HP_CLANGXX} -std=c++17 -O1 -g ${flags} -I${PROJECT_SOURCE_DIR} ${F_SOURCES}
              ${libs} -o ${fuzzer}
      DEPENDS ${F_SOURCES} ${F_DEPENDS}
      COMMENT "libFuzzer target ${F_TARGET} (clang++)"
      VERBATIM)
    add_custom_target(${F_TARGET} ALL DEPENDS ${fuzzer})
  endif()
  string(TOLOWER "hp_${F_SUITE}_scratch" fixture)
  set(scratch ${CMAKE_CURRENT_BINARY_DIR}/fuzz_scratch)
  add_test(NAME ${F_SUITE}.LibFuzzerSeeded
           COMMAND ${CMAKE_COMMAND} -E env ASAN_OPTIONS=detect_leaks=0
                   ${fuzzer} -seed=1 -runs=20000 -max_total_time=60 -rss_limit_mb=0 -malloc_limit_mb=2048
                   -timeout=30 ${scratch} ${F_CORPUS})
  set_tests_properties(${F_SUITE}.LibFuzzerSeeded PROPERTIES
    WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR} TIMEOUT 120 FIXTURES_REQUIRED ${fixture})
  add_test(NAME ${F_SUITE}.ScratchFolder
           COMMAND sh -c "rm -rf fuzz_scratch && mkdir fuzz_scratch"
           WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
  set_tests_properties(${F_SUITE}.ScratchFolder PROPERTIES FIXTURES_SETUP ${fixture})
endfunction()
