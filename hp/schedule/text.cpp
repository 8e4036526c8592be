// hp/schedule/text.cpp: escaping untrusted bytes for error messages.
#include "hp/schedule/text.h"

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

}  // namespace hp::schedule
