// hp/schedule/text.h: text in and out. Untrusted bytes (file contents, user
// input) shown in error messages safely, escaped and cut at a bound; and
// output files written whole or not at all (devices, pipes and descriptors in
// place, every write checked), for every room and tool (this is the lowest
// room that needs no LibTorch).
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

namespace hp::schedule {

/// `text` as printable ASCII for an error message: printable characters as
/// they are, \n \r \t and \\ escaped, every other byte (control characters,
/// NUL, bytes above 0x7e) as \xNN; cut after `max_chars` input bytes with
/// "..." and the total length appended. Never stops at a NUL byte.
std::string escape_bytes(std::string_view text, std::size_t max_chars = 80);

/// Writes `data` to `path` as what is there asks (NOTE [Output files are
/// whole]). A regular file, or a path that does not exist yet, is written
/// whole: into a temporary file beside the final target of any chain of
/// symlinks (its name holds ".tmp."), fsynced and closed with every error
/// checked, then renamed over that target, so a link stays a link and its
/// target gets the data, and an existing file keeps its permission bits.
/// Anything else (a character or block device, a FIFO, a socket, one of this
/// process's descriptors such as /dev/stdout) is written in place, every write
/// checked. Throws std::runtime_error naming the path and the system's reason
/// (a full disk, a short write, a reader that closed its pipe, a missing
/// folder); a regular file is then untouched and no temporary is left.
/// `halfway`, if set, runs once half the bytes are written (a test's fault
/// point).
void write_text_file(const std::string& path, std::string_view data,
                     const std::function<void()>& halfway = {});

/// Refuses, before any work starts, an output path write_text_file() could not
/// write: a folder that does not exist or is not writable (of the final
/// target, symlinks followed), a folder given as the file, a device, FIFO or
/// descriptor that is not writable, a chain of links that does not end.
/// Throws std::invalid_argument naming `option` (e.g. "--csv"; may be empty),
/// the path and what to do.
void check_output_path(const std::string& path, const std::string& option = "");

}  // namespace hp::schedule
