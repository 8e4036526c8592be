// hp/schedule/text.h: text in and out. Untrusted bytes (file contents, user
// input) shown in error messages safely, escaped and cut at a bound; and
// output files written whole or not at all, for every room and tool (this is
// the lowest room that needs no LibTorch).
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

/// Writes `data` to `path` whole: into a temporary file beside it (its name
/// holds ".tmp."), fsynced and closed with every error checked (a full disk,
/// a missing folder, no permission), then renamed over `path`. Throws
/// std::runtime_error naming the path and the system's reason; `path` is
/// then untouched (NOTE [Output files are whole]). `halfway`, if set, runs
/// once half the bytes are written (a test's fault point).
void write_text_file(const std::string& path, std::string_view data,
                     const std::function<void()>& halfway = {});

}  // namespace hp::schedule
