// hp/schedule/text.cpp: escaping untrusted bytes for error messages; output
// files written whole.
#include "hp/schedule/text.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace hp::schedule {

std::string escape_bytes(std::string_view text, std::size_t max_chars) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  const std::size_t n = text.size() < max_chars ? text.size() : max_chars;
  out.reserve(n + 16);
  for (std::size_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\\') {
      out += "\\\\";
    } else if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  if (text.size() > n) out += "... (" + std::to_string(text.size()) + " bytes)";
  return out;
}

// NOTE [Output files are whole]
// An std::ofstream that cannot write (a full disk) sets its fail bit and goes
// on; unchecked, a report, a tuned schedule or a CSV came out empty or cut
// while the tool said "wrote" and exited 0. Every output file, checkpoints
// included, goes through write_text_file: a temporary beside the target (same
// file system, so the rename is atomic; its name holds ".tmp."), every write,
// the fsync and the close checked, renamed over the target, and the folder
// fsynced so that the rename itself reaches the disk.
void write_text_file(const std::string& path, std::string_view data,
                     const std::function<void()>& halfway) {
  static std::atomic<int> counter{0};
  const std::string tmp =
      path + ".tmp." + std::to_string(::getpid()) + "-" + std::to_string(counter++);
  auto fail = [&](const std::string& what, int err) {
    ::unlink(tmp.c_str());
    throw std::runtime_error("cannot write '" + escape_bytes(path, 200) + "': " + what + ": " +
                             std::strerror(err));
  };
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot create a temporary file", errno);
  size_t done = 0;
  bool half_done = false;
  while (done < data.size()) {
    size_t chunk = std::min<size_t>(data.size() - done, size_t(1) << 24);
    if (!half_done && halfway && done + chunk > data.size() / 2) chunk = data.size() / 2 - done;
    ssize_t n = chunk == 0 ? 0 : ::write(fd, data.data() + done, chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      fail("write", err);
    }
    done += static_cast<size_t>(n);
    if (!half_done && halfway && done >= data.size() / 2) {
      half_done = true;
      halfway();
    }
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    fail("fsync", err);
  }
  if (::close(fd) != 0) fail("close", errno);
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("rename", errno);
  const auto slash = path.rfind('/');
  const std::string parent = slash == std::string::npos ? "."
                             : slash == 0               ? "/"
                                                        : path.substr(0, slash);
  int dfd = ::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace hp::schedule
