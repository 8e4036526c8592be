// hp/schedule/text.cpp: escaping untrusted bytes for error messages; output
// files written whole, or in place where the path is a device, a pipe or a
// descriptor; output paths checked before any work.
#include "hp/schedule/text.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
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
// included, goes through write_text_file, which first looks at what is at the
// path. A temporary file and a rename are right for a regular file and wrong
// for anything else: they once replaced the device node /dev/full with a
// regular file holding a CSV, a symlink with a file (its target left empty),
// a FIFO a reader waited on with a file (the reader got nothing), all with
// exit status 0. So:
// - Symlinks are followed link by link (a missing last target included) to
//   the final target; that is the path written, so a link stays a link.
// - A regular file there, or nothing yet: a temporary beside the final
//   target (same folder, same file system, so the rename is atomic; its name
//   holds ".tmp."), every write, the fsync and the close checked, the old
//   file's permission bits kept, renamed over the target, and the folder
//   fsynced so that the rename itself reaches the disk. On any failure the
//   temporary is removed and the old file is untouched.
// - Anything else is written in place, never removed or replaced: a
//   character or block device or a FIFO is opened for writing as it is (a
//   FIFO waits for its reader, as a shell's `>` does), a socket is connected
//   to, and one of this process's own descriptors (/dev/stdout, /dev/stderr,
//   /dev/fd/N, /proc/self/fd/N: links into /proc that name a pipe or a
//   terminal, not a path) is written through that descriptor, after C's and
//   C++'s buffers of stdout and stderr are flushed so the order holds. Every
//   write is checked: ENOSPC (/dev/full), EPIPE (a reader that closed; SIGPIPE
//   is held back for the write so that it is an error, not a silent death)
//   and a write that takes nothing are errors naming the path. A partial
//   stream cannot be taken back; the error says so by the exit status.
// - check_output_path() refuses at once what could not be written (a missing
//   or read-only folder, a folder as the file), so a long run does not fail
//   only at its end; every `hp schedule` output option is checked before any
//   work.
namespace {

constexpr int kMaxLinks = 40;  // as the kernel's own limit on a path's links

enum class Kind { File, InPlace, Descriptor };

struct Target {
  Kind kind = Kind::File;
  std::string path;  // the final target (File), what to open (InPlace)
  int fd = -1;       // Descriptor
  bool exists = false;
  mode_t mode = 0;
};

[[noreturn]] void refuse(const std::string& path, const std::string& why, int err = 0,
                         const std::string& hint = "") {
  throw std::runtime_error("cannot write '" + escape_bytes(path, 200) + "': " + why +
                           (err ? std::string(": ") + std::strerror(err) : std::string()) +
                           (hint.empty() ? std::string() : "; " + hint));
}

// One of this process's descriptors named as a file: /dev/stdout, /dev/fd/1, ...
int descriptor_of(const std::string& p) {
  if (p == "/dev/stdin") return 0;
  if (p == "/dev/stdout") return 1;
  if (p == "/dev/stderr") return 2;
  for (const char* prefix : {"/dev/fd/", "/proc/self/fd/", "/proc/thread-self/fd/"}) {
    const std::string pre = prefix;
    if (p.size() <= pre.size() || p.size() > pre.size() + 9 || p.compare(0, pre.size(), pre) != 0)
      continue;
    int fd = 0;
    for (size_t i = pre.size(); i < p.size(); ++i) {
      if (p[i] < '0' || p[i] > '9') return -1;
      fd = fd * 10 + (p[i] - '0');
    }
    return fd;
  }
  return -1;
}

std::string folder_of(const std::string& p) {
  const auto slash = p.rfind('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : p.substr(0, slash);
}

// What is at `path`, symlinks followed to their final target.
Target resolve(const std::string& path) {
  if (path.empty()) refuse(path, "the path is empty; give a file name");
  std::string cur = path;
  for (int hop = 0; hop <= kMaxLinks; ++hop) {
    Target t;
    t.fd = descriptor_of(cur);
    if (t.fd >= 0) {
      t.kind = Kind::Descriptor;
      t.path = cur;
      return t;
    }
    struct stat st {};
    if (::lstat(cur.c_str(), &st) != 0) {
      if (errno != ENOENT) refuse(path, "cannot look at '" + escape_bytes(cur, 200) + "'", errno);
      t.path = cur;  // a new file (its folder is checked when it is made)
      return t;
    }
    if (S_ISLNK(st.st_mode)) {
      // A link inside /proc names a pipe, a socket or a deleted file ("pipe:[7]"),
      // not a path: only opening the link itself reaches what it stands for.
      if (cur.compare(0, 6, "/proc/") == 0) {
        t.kind = Kind::InPlace;
        t.path = cur;
        t.exists = true;
        return t;
      }
      std::string to(static_cast<size_t>(st.st_size > 0 ? st.st_size : 0) + 256, '\0');
      const ssize_t n = ::readlink(cur.c_str(), to.data(), to.size());
      if (n < 0) refuse(path, "cannot read the link '" + escape_bytes(cur, 200) + "'", errno);
      to.resize(static_cast<size_t>(n));
      cur = !to.empty() && to[0] == '/' ? to : folder_of(cur) + "/" + to;
      continue;
    }
    t.path = cur;
    t.exists = true;
    t.mode = st.st_mode;
    if (S_ISDIR(st.st_mode))
      refuse(path, (cur == path ? std::string("it is a folder")
                                : "it leads to the folder '" + escape_bytes(cur, 200) + "'") +
                       "; give a file name");
    t.kind = S_ISREG(st.st_mode) ? Kind::File : Kind::InPlace;
    return t;
  }
  refuse(path, "more than " + std::to_string(kMaxLinks) + " symlinks (a loop?)", ELOOP);
}

// SIGPIPE held back on this thread while it writes, so that writing to a pipe
// whose reader has gone is the error EPIPE instead of the process's death; a
// SIGPIPE raised meanwhile is taken away, one that was pending before is kept.
class HoldSigpipe {
 public:
  HoldSigpipe() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigemptyset(&pending);
    ::sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    ::pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
  }
  ~HoldSigpipe() {
    if (!was_pending_) {
      sigset_t pending;
      sigemptyset(&pending);
      ::sigpending(&pending);
      if (sigismember(&pending, SIGPIPE) == 1) {
        const timespec zero{0, 0};
        ::sigtimedwait(&pipe_, nullptr, &zero);
      }
    }
    ::pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  HoldSigpipe(const HoldSigpipe&) = delete;
  HoldSigpipe& operator=(const HoldSigpipe&) = delete;

 private:
  sigset_t pipe_{}, old_{};
  bool was_pending_ = false;
};

// What to do about a failed write, where there is something to say.
std::string hint_for(int err) {
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      return "free some space or give a path on another device";
    case EPIPE:
      return "the reader closed its end before it had everything";
    default:
      return "";
  }
}

// Every byte of `data` to `fd`, each write checked; `fail(what, errno)` on an
// error (errno 0: a write that took nothing).
template <class Fail>
void write_all(int fd, std::string_view data, const std::function<void()>& halfway, Fail fail) {
  HoldSigpipe hold;
  size_t done = 0;
  bool half_done = false;
  while (done < data.size()) {
    size_t chunk = std::min<size_t>(data.size() - done, size_t(1) << 24);
    if (!half_done && halfway && done + chunk > data.size() / 2) chunk = data.size() / 2 - done;
    const ssize_t n = chunk == 0 ? 0 : ::write(fd, data.data() + done, chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail("write", errno);
    if (n == 0 && chunk > 0)
      fail("write: a short write (" + std::to_string(done) + " of " + std::to_string(data.size()) +
               " bytes taken)",
           0);
    done += static_cast<size_t>(n);
    if (!half_done && halfway && done >= data.size() / 2) {
      half_done = true;
      halfway();
    }
  }
}

// A socket at a path: connected to (a stream socket), then written.
int connect_socket(const std::string& path, const std::string& shown) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path)
    refuse(shown, "the socket's path is longer than " + std::to_string(sizeof addr.sun_path - 1) +
                      " bytes");
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) refuse(shown, "cannot make a socket", errno);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    const int err = errno;
    ::close(fd);
    refuse(shown, "cannot connect to the socket", err);
  }
  return fd;
}

void write_in_place(const std::string& shown, const Target& t, std::string_view data,
                    const std::function<void()>& halfway) {
  int fd = t.fd;
  if (t.kind == Kind::Descriptor) {
    if (fd == 1 || fd == 2) {  // what was printed before comes first
      std::cout.flush();
      std::cerr.flush();
      std::fflush(fd == 1 ? stdout : stderr);
    }
  } else if (S_ISSOCK(t.mode)) {
    fd = connect_socket(t.path, shown);
  } else {
    do {
      fd = ::open(t.path.c_str(), O_WRONLY | O_NOCTTY | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) refuse(shown, "cannot open it for writing", errno);
  }
  const bool own = t.kind != Kind::Descriptor;
  write_all(fd, data, halfway, [&](const std::string& what, int err) {
    if (own) ::close(fd);
    refuse(shown, what, err, hint_for(err));
  });
  if (own && ::close(fd) != 0) refuse(shown, "close", errno);
}

void write_whole(const std::string& shown, const Target& t, std::string_view data,
                 const std::function<void()>& halfway) {
  static std::atomic<int> counter{0};
  const std::string& path = t.path;
  const std::string tmp =
      path + ".tmp." + std::to_string(::getpid()) + "-" + std::to_string(counter++);
  auto fail = [&](const std::string& what, int err) {
    ::unlink(tmp.c_str());
    refuse(shown, what, err, hint_for(err));
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    fail("cannot create a temporary file beside '" + escape_bytes(path, 200) + "'", errno);
  auto fail_open = [&](const std::string& what, int err) {
    ::close(fd);
    fail(what, err);
  };
  if (t.exists && ::fchmod(fd, t.mode & 07777) != 0) fail_open("fchmod", errno);
  write_all(fd, data, halfway, fail_open);
  if (::fsync(fd) != 0) fail_open("fsync", errno);
  if (::close(fd) != 0) fail("close", errno);
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("rename", errno);
  const int dfd = ::open(folder_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace

void write_text_file(const std::string& path, std::string_view data,
                     const std::function<void()>& halfway) {
  const Target t = resolve(path);
  if (t.kind == Kind::File)
    write_whole(path, t, data, halfway);
  else
    write_in_place(path, t, data, halfway);
}

void check_output_path(const std::string& path, const std::string& option) {
  const std::string head = "cannot write '" + escape_bytes(path, 200) + "'" +
                           (option.empty() ? std::string() : " (" + option + ")") + ": ";
  Target t;
  try {
    t = resolve(path);
  } catch (const std::runtime_error& e) {
    std::string msg = e.what();
    const std::string old = "cannot write '" + escape_bytes(path, 200) + "': ";
    if (msg.compare(0, old.size(), old) == 0) msg = msg.substr(old.size());
    throw std::invalid_argument(head + msg);
  }
  if (t.kind == Kind::Descriptor) {
    const int flags = ::fcntl(t.fd, F_GETFL);
    if (flags < 0)
      throw std::invalid_argument(head + "descriptor " + std::to_string(t.fd) + " is not open");
    if ((flags & O_ACCMODE) == O_RDONLY)
      throw std::invalid_argument(head + "descriptor " + std::to_string(t.fd) +
                                  " is open for reading only");
    return;
  }
  if (t.kind == Kind::InPlace) {
    if (!S_ISSOCK(t.mode) && ::access(t.path.c_str(), W_OK) != 0)
      throw std::invalid_argument(head + "it is not writable (" + std::strerror(errno) +
                                  "); give another path");
    return;
  }
  const std::string folder = folder_of(t.path);
  const std::string where = t.path == path
                                ? std::string()
                                : " (where the link leads: '" + escape_bytes(t.path, 200) + "')";
  struct stat st {};
  if (::stat(folder.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR)
      throw std::invalid_argument(head + "the folder '" + escape_bytes(folder, 200) + "'" + where +
                                  " does not exist; create it or give a path in a folder that "
                                  "exists");
    throw std::invalid_argument(head + "cannot look at the folder '" + escape_bytes(folder, 200) +
                                "'" + where + ": " + std::strerror(errno));
  }
  if (!S_ISDIR(st.st_mode))
    throw std::invalid_argument(head + "'" + escape_bytes(folder, 200) + "'" + where +
                                " is not a folder");
  if (::access(folder.c_str(), W_OK | X_OK) != 0)
    throw std::invalid_argument(head + "the folder '" + escape_bytes(folder, 200) + "'" + where +
                                " is not writable (" + std::strerror(errno) +
                                "); give a path in a folder you can write");
}

}  // namespace hp::schedule
