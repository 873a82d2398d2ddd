// Each rank's TORCHELASTIC_ERROR_FILE, as torchrun gives them: dcomm (and a
// torch program) writes there why it failed (dcomm/trace/error_file.hpp),
// and dcomm-run prints the message of the rank it blames, and hands it on
// to its own launcher's error file where it has one.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>

#include "dcomm/trace/error_file.hpp"

namespace dcomm_run {

// The JSON string literal that starts at text[pos] ('"'), unescaped; pos
// moves past it. Empty where there is none.
inline std::string json_string_at(std::string_view text, std::size_t pos) {
  std::string s;
  if (pos >= text.size() || text[pos] != '"') return s;
  for (++pos; pos < text.size() && text[pos] != '"'; ++pos) {
    char c = text[pos];
    if (c != '\\' || pos + 1 >= text.size()) {
      s += c;
      continue;
    }
    c = text[++pos];
    if (c == 'n') {
      s += '\n';
    } else if (c == 't') {
      s += '\t';
    } else if (c == 'u' && pos + 4 < text.size()) {
      const unsigned long u =
          std::strtoul(std::string(text.substr(pos + 1, 4)).c_str(), nullptr, 16);
      s += u < 0x80 ? static_cast<char>(u) : '?';  // dcomm escapes control characters only
      pos += 4;
    } else {
      s += c;  // \" \\ \/
    }
  }
  return s;
}

// The message of an error file in torch's format: {"message": {"message":
// "..."}} or {"message": "..."}. Empty where there is none.
inline std::string error_file_message(std::string_view json) {
  std::size_t at = json.find("\"message\"");
  if (at == std::string_view::npos) return {};
  at = json.find_first_not_of(" \t\r\n:", at + 9);
  if (at != std::string_view::npos && json[at] == '{') {
    at = json.find("\"message\"", at);
    if (at == std::string_view::npos) return {};
    at = json.find_first_not_of(" \t\r\n:", at + 9);
  }
  return at == std::string_view::npos ? std::string() : json_string_at(json, at);
}

class error_files {
 public:
  error_files() = default;
  error_files(const error_files&) = delete;
  error_files& operator=(const error_files&) = delete;
  ~error_files() {
    std::error_code ignored;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
  }

  // A fresh folder for them (none, and no files, where it cannot be made).
  void prepare() {
    char name[] = "/tmp/dcomm-run-errors-XXXXXX";
    if (::mkdtemp(name)) dir_ = name;
  }

  // The path rank `rank` is given (empty: none).
  std::string path_for(int rank) const {
    return dir_.empty() ? std::string() : dir_ + "/" + std::to_string(rank) + ".json";
  }

  // Removes what rank `rank` wrote there (its slot's next process writes anew).
  void forget(int rank) const {
    std::error_code ignored;
    if (!dir_.empty()) std::filesystem::remove(path_for(rank), ignored);
  }

  // What rank `rank` wrote there (empty: nothing).
  std::string message_of(int rank) const {
    if (dir_.empty()) return {};
    std::ifstream f(path_for(rank));
    std::stringstream text;
    text << f.rdbuf();
    return error_file_message(text.str());
  }

 private:
  std::string dir_;
};

}  // namespace dcomm_run
