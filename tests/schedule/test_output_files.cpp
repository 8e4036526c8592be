// tests/schedule/test_output_files.cpp: write_text_file respects what is at
// the path (NOTE [Output files are whole]): a symlink stays a link and its
// target gets the data, a FIFO and a socket get the data in place, device
// nodes made by the test (never the machine's own /dev) are written in place
// or fail loudly, a full file system of the test's own leaves the old file and
// no temporaries; check_output_path refuses what cannot be written.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

#include "hp/schedule/text.h"

namespace {

namespace hs = hp::schedule;

// A fresh folder of the test's own, removed with what is in it.
struct TempDir {
  std::string path;
  TempDir() {
    std::string tmpl = ::testing::TempDir() + "hp_out_XXXXXX";
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path = tmpl;
  }
  ~TempDir() { std::system(("rm -rf '" + path + "'").c_str()); }
  std::string operator/(const std::string& name) const { return path + "/" + name; }
};

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

mode_t kind_of(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return 0;
  return st.st_mode & S_IFMT;
}

std::string big_text(size_t n) {
  std::string s;
  s.reserve(n);
  for (size_t i = 0; s.size() < n; ++i)
    s += "line " + std::to_string(i) + "\n";
  s.resize(n);
  return s;
}

int count_temporaries(const std::string& dir) {
  const std::string cmd = "ls -a '" + dir + "' | grep -c '\\.tmp\\.'";
  FILE* f = ::popen(cmd.c_str(), "r");
  int n = -1;
  if (f) {
    if (std::fscanf(f, "%d", &n) != 1) n = -1;
    ::pclose(f);
  }
  return n;
}

}  // namespace

TEST(OutputFiles, RegularFileWrittenWholeKeepsItsMode) {
  TempDir d;
  const std::string path = d / "out.csv";
  hs::write_text_file(path, "first\n");
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  hs::write_text_file(path, "second\n");
  EXPECT_EQ(read_all(path), "second\n");
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(count_temporaries(d.path), 0);
}

// A chain of two relative links: both stay links, the final target gets the
// data (before: the first link was replaced by a file, the target stayed
// empty); a link to a file not made yet makes that file.
TEST(OutputFiles, SymlinkStaysALinkAndItsTargetGetsTheData) {
  TempDir d;
  ASSERT_EQ(::mkdir((d / "real").c_str(), 0755), 0);
  hs::write_text_file(d / "real/out.csv", "old\n");
  ASSERT_EQ(::symlink("real/out.csv", (d / "link.csv").c_str()), 0);
  ASSERT_EQ(::symlink("link.csv", (d / "link2.csv").c_str()), 0);
  hs::write_text_file(d / "link2.csv", "new data\n");
  EXPECT_EQ(kind_of(d / "link2.csv"), static_cast<mode_t>(S_IFLNK));
  EXPECT_EQ(kind_of(d / "link.csv"), static_cast<mode_t>(S_IFLNK));
  EXPECT_EQ(kind_of(d / "real/out.csv"), static_cast<mode_t>(S_IFREG));
  EXPECT_EQ(read_all(d / "real/out.csv"), "new data\n");
  EXPECT_EQ(count_temporaries(d.path), 0);
  EXPECT_EQ(count_temporaries(d / "real"), 0);
  ASSERT_EQ(::symlink("real/later.csv", (d / "dangling.csv").c_str()), 0);
  hs::write_text_file(d / "dangling.csv", "made\n");
  EXPECT_EQ(kind_of(d / "dangling.csv"), static_cast<mode_t>(S_IFLNK));
  EXPECT_EQ(read_all(d / "real/later.csv"), "made\n");
  // A loop of links is refused, naming the path.
  ASSERT_EQ(::symlink("loop_b", (d / "loop_a").c_str()), 0);
  ASSERT_EQ(::symlink("loop_a", (d / "loop_b").c_str()), 0);
  try {
    hs::write_text_file(d / "loop_a", "x");
    ADD_FAILURE() << "a loop of links was written";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("symlinks (a loop?)"), std::string::npos) << e.what();
  }
}

// A FIFO with a reader: the reader gets every byte (more than a pipe holds),
// the FIFO stays a FIFO (before: it was replaced by a file, the reader got
// nothing).
TEST(OutputFiles, FifoWithAReaderGetsTheDataInPlace) {
  TempDir d;
  const std::string fifo = d / "pipe";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  const std::string data = big_text(1 << 20);
  std::string got;
  std::thread reader([&] {
    const int fd = ::open(fifo.c_str(), O_RDONLY);
    if (fd < 0) return;
    char buf[65536];
    ssize_t n;
    while ((n = ::read(fd, buf, sizeof buf)) > 0)
      got.append(buf, static_cast<size_t>(n));
    ::close(fd);
  });
  hs::write_text_file(fifo, data);
  reader.join();
  EXPECT_EQ(got.size(), data.size());
  EXPECT_TRUE(got == data);
  EXPECT_EQ(kind_of(fifo), static_cast<mode_t>(S_IFIFO));
  EXPECT_EQ(count_temporaries(d.path), 0);
}

// A reader that closes early: an error naming the path, not the process's
// death by SIGPIPE, and no SIGPIPE left pending.
TEST(OutputFiles, FifoWhoseReaderClosesIsAnError) {
  TempDir d;
  const std::string fifo = d / "pipe";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  std::thread reader([&] {
    const int fd = ::open(fifo.c_str(), O_RDONLY);
    if (fd < 0) return;
    char buf[16];
    (void)::read(fd, buf, sizeof buf);
    ::close(fd);
  });
  try {
    hs::write_text_file(fifo, big_text(8 << 20));
    ADD_FAILURE() << "a write into a closed pipe succeeded";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("Broken pipe"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("the reader closed"), std::string::npos) << e.what();
  }
  reader.join();
  EXPECT_EQ(kind_of(fifo), static_cast<mode_t>(S_IFIFO));
  sigset_t pending;
  sigemptyset(&pending);
  ::sigpending(&pending);
  EXPECT_EQ(sigismember(&pending, SIGPIPE), 0);
}

// One of this process's descriptors named as a file (what /dev/stdout is):
// written through the descriptor.
TEST(OutputFiles, OwnDescriptorIsWrittenThroughIt) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  hs::write_text_file("/proc/self/fd/" + std::to_string(fds[1]), "through the pipe\n");
  hs::check_output_path("/dev/fd/" + std::to_string(fds[1]), "--csv");
  ::close(fds[1]);
  char buf[64] = {};
  const ssize_t n = ::read(fds[0], buf, sizeof buf - 1);
  ::close(fds[0]);
  EXPECT_EQ(std::string(buf, n > 0 ? static_cast<size_t>(n) : 0), "through the pipe\n");
}

// A listening socket at a path: connected to and written.
TEST(OutputFiles, SocketIsConnectedToAndWritten) {
  TempDir d;
  const std::string path = d / "sock";
  const int srv = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(srv, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  ASSERT_LT(path.size(), sizeof addr.sun_path);
  std::strcpy(addr.sun_path, path.c_str());
  ASSERT_EQ(::bind(srv, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(srv, 1), 0);
  std::string got;
  std::thread reader([&] {
    const int c = ::accept(srv, nullptr, nullptr);
    if (c < 0) return;
    char buf[4096];
    ssize_t n;
    while ((n = ::read(c, buf, sizeof buf)) > 0)
      got.append(buf, static_cast<size_t>(n));
    ::close(c);
  });
  hs::write_text_file(path, "over the socket\n");
  reader.join();
  ::close(srv);
  EXPECT_EQ(got, "over the socket\n");
  EXPECT_EQ(kind_of(path), static_cast<mode_t>(S_IFSOCK));
}

// Device nodes made by the test in its own folder (never the machine's /dev):
// the null device takes the data and stays a device; the full device makes
// the write throw and stays the same device (before: replaced by a regular
// file holding the data, exit status 0).
TEST(OutputFiles, DeviceNodesAreWrittenInPlace) {
  TempDir d;
  const std::string null_dev = d / "null", full_dev = d / "full";
  if (::mknod(null_dev.c_str(), S_IFCHR | 0666, makedev(1, 3)) != 0 ||
      ::mknod(full_dev.c_str(), S_IFCHR | 0666, makedev(1, 7)) != 0)
    GTEST_SKIP() << "\n\n*** SKIPPED: cannot make device nodes here (mknod: "
                 << std::strerror(errno)
                 << "); run the schedule tests as root to check writes to devices ***\n";
  const int probe = ::open(null_dev.c_str(), O_WRONLY);
  if (probe < 0)
    GTEST_SKIP() << "\n\n*** SKIPPED: device nodes cannot be opened in " << d.path << " ("
                 << std::strerror(errno) << "; a nodev mount?) ***\n";
  ::close(probe);
  hs::check_output_path(null_dev, "--csv");
  hs::write_text_file(null_dev, big_text(100000));
  EXPECT_EQ(kind_of(null_dev), static_cast<mode_t>(S_IFCHR));
  try {
    hs::write_text_file(full_dev, "a,b\n");
    ADD_FAILURE() << "a write to the full device succeeded";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot write '" + full_dev + "'"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("No space left on device"), std::string::npos) << e.what();
  }
  struct stat st {};
  ASSERT_EQ(::lstat(full_dev.c_str(), &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  EXPECT_EQ(major(st.st_rdev), 1u);
  EXPECT_EQ(minor(st.st_rdev), 7u);
  EXPECT_EQ(count_temporaries(d.path), 0);
}

// A small tmpfs of the test's own: a write that does not fit throws, the old
// file is untouched and no temporary is left.
TEST(OutputFiles, FullFileSystemLeavesTheOldFileAndNoTemporaries) {
  TempDir d;
  const std::string mnt = d / "small";
  ASSERT_EQ(::mkdir(mnt.c_str(), 0755), 0);
  if (::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=64k") != 0)
    GTEST_SKIP() << "\n\n*** SKIPPED: cannot mount a tmpfs (" << std::strerror(errno)
                 << "); run the schedule tests as root to check a full file system ***\n";
  struct Unmount {
    std::string at;
    ~Unmount() { ::umount2(at.c_str(), MNT_DETACH); }
  } unmount{mnt};
  const std::string path = mnt + "/report.json";
  hs::write_text_file(path, "{\"old\": true}\n");
  try {
    hs::write_text_file(path, big_text(256 << 10));
    ADD_FAILURE() << "256 KiB fit into a 64 KiB file system";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("No space left on device"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("free some space"), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_all(path), "{\"old\": true}\n");
  EXPECT_EQ(count_temporaries(mnt), 0);
  // A read-only file system is refused before any work.
  ASSERT_EQ(::mount("tmpfs", mnt.c_str(), "tmpfs", MS_REMOUNT | MS_RDONLY, "size=64k"), 0);
  try {
    hs::check_output_path(path, "--report");
    ADD_FAILURE() << "a read-only folder was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("(--report)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("is not writable"), std::string::npos) << e.what();
  }
}

TEST(OutputFiles, CheckOutputPathRefusesWhatCannotBeWritten) {
  TempDir d;
  auto refused = [](const std::string& path) {
    try {
      hs::check_output_path(path, "--svg");
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  std::string why = refused(d / "missing/out.svg");
  EXPECT_NE(why.find("cannot write '" + (d / "missing/out.svg") + "' (--svg)"), std::string::npos)
      << why;
  EXPECT_NE(why.find("the folder '" + (d / "missing") + "'"), std::string::npos) << why;
  EXPECT_NE(why.find("does not exist"), std::string::npos) << why;
  why = refused(d.path);
  EXPECT_NE(why.find("it is a folder"), std::string::npos) << why;
  why = refused("");
  EXPECT_NE(why.find("the path is empty"), std::string::npos) << why;
  // A link into a missing folder names where it leads.
  ASSERT_EQ(::symlink("nowhere/x.svg", (d / "l.svg").c_str()), 0);
  why = refused(d / "l.svg");
  EXPECT_NE(why.find("where the link leads"), std::string::npos) << why;
  // What can be written passes: a new file, an existing one, a link to one.
  hs::check_output_path(d / "new.svg", "--svg");
  hs::write_text_file(d / "old.svg", "x");
  hs::check_output_path(d / "old.svg", "--svg");
  ASSERT_EQ(::symlink("old.svg", (d / "ok.svg").c_str()), 0);
  hs::check_output_path(d / "ok.svg", "--svg");
}
