// hp/schedule/text.h: showing untrusted bytes (file contents, user input) in
// error messages safely: escaped and cut at a bound.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace hp::schedule {

/// `text` as printable ASCII for an error message: printable characters as
/// they are, \n \r \t and \\ escaped, every other byte (control characters,
/// NUL, bytes above 0x7e) as \xNN; cut after `max_chars` input bytes with
/// "..." and the total length appended. Never stops at a NUL byte.
std::string escape_bytes(std::string_view text, std::size_t max_chars = 80);

}  // namespace hp::schedule
