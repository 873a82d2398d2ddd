// option_string: the text fields of dcomm's option structs (init_options,
// rendezvous_options, the CPU backend's and the stores' options), held in
// place, without the heap.
//
// Why not std::string: g++ 12 destroys the members of a braced temporary
// inside a co_await expression twice, so
//   co_await dcomm::init_process_group<dcomm::cpu_backend>(ex, {.init_method = "env://"});
// freed the same memory twice where a member was a std::string. An option
// struct made only of trivially destructible members has nothing to
// destroy, and the one-liner above is safe on every compiler.
//
// It converts from and to std::string_view, takes any string on
// assignment, and refuses text longer than its capacity with an
// invalid_argument error (nothing is silently cut).
//
//   dcomm::init_options<dcomm::cpu_backend> o;
//   o.init_method = "tcp://" + host + ":29500";   // copied in
//   std::string_view m = o.init_method;           // and read back
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>

#include "dcomm/error.hpp"

namespace dcomm {

class option_string {
 public:
  // Bytes of text it holds at most: a URL with a file:// path, a host
  // name, a job token or a DCOMM_ALGO list fits.
  static constexpr std::size_t capacity = 1023;

  constexpr option_string() noexcept = default;
  constexpr option_string(const char* text) : option_string(std::string_view(text ? text : "")) {}
  constexpr option_string(std::string_view text) { assign(text); }
  option_string(const std::string& text) : option_string(std::string_view(text)) {}

  constexpr option_string& operator=(std::string_view text) {
    assign(text);
    return *this;
  }
  constexpr option_string& operator=(const char* text) {
    assign(std::string_view(text ? text : ""));
    return *this;
  }
  option_string& operator=(const std::string& text) {
    assign(text);
    return *this;
  }

  constexpr std::string_view view() const noexcept { return {text_, size_}; }
  constexpr operator std::string_view() const noexcept { return view(); }
  std::string str() const { return std::string(view()); }
  constexpr const char* c_str() const noexcept { return text_; }
  constexpr const char* data() const noexcept { return text_; }
  constexpr std::size_t size() const noexcept { return size_; }
  constexpr bool empty() const noexcept { return size_ == 0; }

  friend constexpr bool operator==(const option_string& a, const option_string& b) noexcept {
    return a.view() == b.view();
  }
  friend constexpr bool operator==(const option_string& a, std::string_view b) noexcept {
    return a.view() == b;
  }
  friend constexpr bool operator==(const option_string& a, const char* b) noexcept {
    return a.view() == std::string_view(b ? b : "");
  }

 private:
  constexpr void assign(std::string_view text) {
    if (text.size() > capacity)
      throw_error(errc::invalid_argument,
                  {.operation = "option_string",
                   .detail = "a text option of " + std::to_string(text.size()) +
                             " bytes is longer than the " + std::to_string(capacity) +
                             " an option holds: \"" + std::string(text.substr(0, 60)) + "...\""});
    for (std::size_t i = 0; i < text.size(); ++i) text_[i] = text[i];
    for (std::size_t i = text.size(); i <= size_; ++i) text_[i] = '\0';
    size_ = text.size();
  }

  std::size_t size_ = 0;
  char text_[capacity + 1] = {};
};

static_assert(std::is_trivially_destructible_v<option_string>);
static_assert(std::is_trivially_copyable_v<option_string>);

}  // namespace dcomm
