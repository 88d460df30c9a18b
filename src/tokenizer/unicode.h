// UTF-8 and Unicode functions for the tokenizer. Character classes follow Rust's `char` methods, because the
// reference library (Rust `tokenizers`) decides splits and strips with them.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace tern {

// Length of the UTF-8 sequence that starts with `lead` (1 for a stray continuation byte).
inline size_t utf8_sequence_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xF0) return 4;
  if (lead >= 0xE0) return 3;
  if (lead >= 0xC0) return 2;
  return 1;
}

// Decodes the character at `text[pos]`; `text` must be valid UTF-8.
char32_t utf8_decode_at(std::string_view text, size_t pos, size_t* length);
void utf8_append(std::string& out, char32_t c);
bool utf8_is_valid(std::string_view text);

// Rust's String::from_utf8_lossy: every maximal invalid subsequence becomes one U+FFFD.
std::string utf8_lossy(std::string_view bytes);

bool unicode_is_whitespace(char32_t c);    // char::is_whitespace (White_Space property)
bool unicode_is_numeric(char32_t c);       // char::is_numeric (Nd, Nl, No)
bool unicode_is_punctuation(char32_t c);   // ASCII punctuation or general category P*
bool unicode_is_word(char32_t c);          // regex \w: letters, marks, numbers, connector punctuation

// Lower-cases each character as Rust's char::to_lowercase does.
std::string unicode_lowercase(std::string_view text);

enum class NormalForm { kNfc, kNfd, kNfkc, kNfkd };
// Unicode normalisation with an explicit length, so U+0000 is an ordinary character.
std::string unicode_normalize(std::string_view text, NormalForm form);

// GPT-2 byte-level alphabet: each byte maps to one printable character.
struct ByteLevelAlphabet {
  std::array<std::string, 256> byte_to_utf8;
  std::array<int16_t, 512> char_to_byte;  // indexed by code point (< 512); -1 where not in the alphabet
};
const ByteLevelAlphabet& byte_level_alphabet();
void byte_level_encode(std::string_view bytes, std::string& out);
// Maps a token written in the byte-level alphabet back to bytes; nullopt when a character is outside it.
std::optional<std::string> byte_level_decode(std::string_view token);

}  // namespace tern
