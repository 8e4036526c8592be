// Test helper shared by the end-to-end suites: two network namespaces joined
// by a veth pair (10.231.0.1/24 <-> 10.231.0.2/24), as two hosts would be,
// created for one test and deleted in the destructor whatever happened.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace hp::testing {

inline int sh(const std::string& cmd) {
  int st = std::system((cmd + " >/dev/null 2>&1").c_str());
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/// Two namespaces `<prefix><pid>a` and `<prefix><pid>b`; `error` is set when
/// they could not be made (needs root and iproute2; tests skip visibly then).
struct NetnsPair {
  std::string ns[2], veth[2];
  bool created[2] = {false, false};
  bool veth_created = false;
  std::string error;
  explicit NetnsPair(const std::string& prefix) {
    std::string id = std::to_string(getpid() % 100000);
    for (int k = 0; k < 2; ++k) {
      ns[k] = prefix + id + (k ? "b" : "a");
      veth[k] = "hpv" + prefix.substr(0, 3) + id + (k ? "b" : "a");
    }
    for (int k = 0; k < 2; ++k) {
      if (sh("ip netns add " + ns[k]) != 0) {
        error = "`ip netns add` failed (needs root and iproute2)";
        return;
      }
      created[k] = true;
    }
    std::vector<std::string> steps = {"ip link add " + veth[0] + " type veth peer name " + veth[1],
                                      "ip link set " + veth[0] + " netns " + ns[0],
                                      "ip link set " + veth[1] + " netns " + ns[1],
                                      "ip -n " + ns[0] + " addr add 10.231.0.1/24 dev " + veth[0],
                                      "ip -n " + ns[1] + " addr add 10.231.0.2/24 dev " + veth[1],
                                      "ip -n " + ns[0] + " link set " + veth[0] + " up",
                                      "ip -n " + ns[1] + " link set " + veth[1] + " up",
                                      "ip -n " + ns[0] + " link set lo up",
                                      "ip -n " + ns[1] + " link set lo up"};
    for (size_t i = 0; i < steps.size(); ++i) {
      if (sh(steps[i]) != 0) {
        error = "network setup failed at: " + steps[i];
        return;
      }
      if (i == 0) veth_created = true;
    }
  }
  ~NetnsPair() {
    for (int k = 0; k < 2; ++k)
      if (created[k]) sh("ip netns del " + ns[k]);   // takes its end of the veth with it
    if (veth_created) sh("ip link del " + veth[0]);  // only if it never moved
  }
  NetnsPair(const NetnsPair&) = delete;
  NetnsPair& operator=(const NetnsPair&) = delete;
};

}  // namespace hp::testing
