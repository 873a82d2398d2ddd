// The syntax of an init_method URL (scheme, authority, path, ?query) and of
// the values in it: hosts, ports, integers, each checked with a message that
// names the part to fix. Used by init_method.hpp; nothing here touches the
// network.
#pragma once

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include "dcomm/error.hpp"
#include "dcomm/init/spec.hpp"

namespace dcomm::init {

inline constexpr std::string_view init_operation = "init_method";
inline constexpr std::string_view supported_init_methods =
    "env://, tcp://host:port or file:///absolute/path";

// Values come from URLs and environment variables, which may hold newlines
// or NULs that would cut what() short or garble a log line.
inline std::string printable(std::string_view text) {
  constexpr char hex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f) {
      out += "\\x";
      out += hex[byte >> 4];
      out += hex[byte & 0xf];
    } else {
      out += c;
    }
  }
  return out;
}

inline std::string in_quotes(std::string_view text) {
  return "'" + printable(text) + "'";
}

[[noreturn]] inline void throw_init_error(std::string_view url, std::string_view key,
                                          std::string expected, std::string seen,
                                          std::string detail = {}) {
  error_context context;
  context.operation = init_operation;
  context.key = key;
  context.address = printable(url);
  context.expected = std::move(expected);
  context.seen = std::move(seen);
  context.detail = std::move(detail);
  throw_error(errc::invalid_argument, std::move(context));
}

inline bool is_ascii_digit(char c) {
  return c >= '0' && c <= '9';
}
inline bool is_ascii_alpha(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}
inline bool is_hex_digit(char c) {
  return is_ascii_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}
inline char ascii_lower(char c) {
  return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c;
}

// Where a value came from, phrased for messages: "RANK='4'",
// "rank='4' in the query string", "rank=4 passed in code", "port '0' in the URL".
enum class value_origin { code, query, url, environment };

struct value_source {
  value_origin origin;
  std::string name;  // variable or parameter name; goes to error_context::key
  std::string text;  // the value as written

  std::string describe() const {
    switch (origin) {
      case value_origin::code:
        return name + "=" + text + " passed in code";
      case value_origin::query:
        return name + "=" + in_quotes(text) + " in the query string";
      case value_origin::url:
        return name + " " + in_quotes(text) + " in the URL";
      case value_origin::environment:
        break;
    }
    return name + "=" + in_quotes(text);
  }
};

struct sourced_int {
  int value;
  value_source source;
};

// std::from_chars, because it rejects leading blanks and '+' and reports
// overflow instead of wrapping, and we check that it consumed everything.
inline int parse_int(const value_source& source, std::string_view url, std::string_view meaning) {
  const std::string_view text = source.text;
  int value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec == std::errc::invalid_argument)
    throw_init_error(url, source.name, "an integer " + std::string(meaning), source.describe(),
                     source.name + " must be a plain decimal integer");
  if (ec == std::errc::result_out_of_range)
    throw_init_error(url, source.name, "an integer " + std::string(meaning), source.describe(),
                     "the number does not fit in an int (" +
                         std::to_string(std::numeric_limits<int>::min()) + ".." +
                         std::to_string(std::numeric_limits<int>::max()) + ")");
  if (end != text.data() + text.size())
    throw_init_error(url, source.name, "an integer " + std::string(meaning), source.describe(),
                     "unexpected " +
                         in_quotes(std::string_view(end, text.data() + text.size() - end)) +
                         " after the number");
  return value;
}

inline std::optional<std::string> lookup(const env_lookup& env, std::string_view name) {
  if (!env) return std::nullopt;
  return env(name);
}

inline std::optional<sourced_int> env_int(const env_lookup& env, std::string_view name,
                                          std::string_view url, std::string_view meaning) {
  auto text = lookup(env, name);
  if (!text) return std::nullopt;
  value_source source{value_origin::environment, std::string(name), std::move(*text)};
  const int value = parse_int(source, url, meaning);
  return sourced_int{value, std::move(source)};
}

// Rank and local rank: 0 or more. Sizes: 1 or more.
inline void check_rank_value(const sourced_int& v, std::string_view url, std::string_view what) {
  if (v.value < 0)
    throw_init_error(url, v.source.name, std::string(what) + " >= 0", v.source.describe(),
                     v.source.origin == value_origin::code
                         ? "pass std::nullopt to take it from the URL or the environment"
                         : std::string{});
}

inline void check_size_value(const sourced_int& v, std::string_view url, std::string_view what) {
  if (v.value < 1)
    throw_init_error(
        url, v.source.name, std::string(what) + " >= 1", v.source.describe(),
        v.value == 0 ? std::string(what) + " 0 would be a group with no ranks" : std::string{});
}

inline void check_rank_below_size(const sourced_int& rank, const sourced_int& size,
                                  std::string_view url, std::string_view rank_word,
                                  std::string_view size_word) {
  if (rank.value < size.value) return;
  throw_init_error(url, rank.source.name,
                   std::string(rank_word) + " < " + std::string(size_word) + ", i.e. in 0.." +
                       std::to_string(size.value - 1),
                   rank.source.describe() + " and " + size.source.describe(),
                   std::string(rank_word) + "s are numbered from 0, so " + std::string(rank_word) +
                       " " + std::to_string(rank.value) + " does not exist in a " +
                       std::string(size_word) + " of " + std::to_string(size.value));
}

// A host as written in MASTER_ADDR or in a tcp:// URL, brackets removed.
inline bool is_host_name(std::string_view host) {
  if (host.empty()) return false;
  for (char c : host)
    if (!is_ascii_alpha(c) && !is_ascii_digit(c) && c != '-' && c != '.' && c != '_') return false;
  return true;
}

// Loose on purpose: the resolver gives the final word, this only catches
// what can never be an IPv6 address, such as "host:port". A zone
// ("fe80::1%eth0") is kept, taken literally as Python's urlparse does.
inline bool is_ipv6_literal(std::string_view host) {
  const std::size_t percent = host.find('%');
  const std::string_view address = host.substr(0, percent);
  int colons = 0;
  for (char c : address) {
    if (c == ':')
      ++colons;
    else if (!is_hex_digit(c) && c != '.')
      return false;
  }
  if (colons < 2) return false;
  if (percent == std::string_view::npos) return true;
  const std::string_view zone = host.substr(percent + 1);
  return is_host_name(zone);
}

inline std::string checked_master_addr(std::string_view value, std::string_view url,
                                       const std::string& name = "MASTER_ADDR") {
  const value_source source{value_origin::environment, name, std::string(value)};
  std::string_view host = value;
  const bool bracketed = host.size() >= 2 && host.front() == '[' && host.back() == ']';
  if (bracketed) host = host.substr(1, host.size() - 2);
  if (host.empty())
    throw_init_error(url, name, "the host name or IP address of rank 0", source.describe(),
                     name + " is empty");
  if (host.find(':') != std::string_view::npos || bracketed) {
    if (is_ipv6_literal(host)) return std::string(host);
    const bool host_port = !bracketed && host.find(':') == host.rfind(':');
    throw_init_error(url, name, "the host name or IP address of rank 0", source.describe(),
                     host_port ? "this looks like host:port; put the port in MASTER_PORT"
                               : "not a valid IPv6 address");
  }
  if (!is_host_name(host))
    throw_init_error(url, name, "the host name or IP address of rank 0", source.describe(),
                     "a host name may only hold letters, digits, '-', '.' and '_'");
  return std::string(host);
}

inline std::uint16_t checked_port(const value_source& source, std::string_view url) {
  const int port = parse_int(source, url, "port in 1..65535");
  if (port == 0)
    throw_init_error(url, source.name, "a port in 1..65535", source.describe(),
                     "port 0 would let the system pick a free port that the other ranks "
                     "could not know; choose a fixed port such as 29500");
  if (port < 0 || port > 65535)
    throw_init_error(url, source.name, "a port in 1..65535", source.describe());
  return static_cast<std::uint16_t>(port);
}

struct url_parts {
  std::string scheme;  // lower case
  bool has_authority = false;
  std::string_view authority, path, query;
};

inline url_parts split_url(std::string_view url) {
  if (url.empty())
    throw_init_error(url, "init_method", std::string(supported_init_methods), "an empty string");
  const auto is_blank = [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
  };
  if (is_blank(url.front()) || is_blank(url.back()))
    throw_init_error(url, "init_method", std::string(supported_init_methods), in_quotes(url),
                     "remove the blanks around the URL");
  for (char c : url)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
      throw_init_error(url, "init_method", std::string(supported_init_methods), in_quotes(url),
                       "the URL contains a control character");

  const std::size_t colon = url.find(':');
  bool scheme_ok = colon != std::string_view::npos && colon > 0 && is_ascii_alpha(url[0]);
  for (std::size_t i = 0; scheme_ok && i < colon; ++i) {
    const char c = url[i];
    scheme_ok = is_ascii_alpha(c) || is_ascii_digit(c) || c == '+' || c == '-' || c == '.';
  }
  if (!scheme_ok)
    throw_init_error(url, "init_method", std::string(supported_init_methods), in_quotes(url),
                     "not a URL: it must start with env://, tcp:// or file://");

  url_parts parts;
  for (char c : url.substr(0, colon)) parts.scheme += ascii_lower(c);

  std::string_view rest = url.substr(colon + 1);
  if (const std::size_t hash = rest.find('#'); hash != std::string_view::npos)
    throw_init_error(url, "init_method", "no fragment", in_quotes(rest.substr(hash)),
                     "dcomm does not understand URL fragments; remove the '#' part");
  if (const std::size_t question = rest.find('?'); question != std::string_view::npos) {
    parts.query = rest.substr(question + 1);
    rest = rest.substr(0, question);
  }
  if (rest.substr(0, 2) == "//") {
    parts.has_authority = true;
    rest = rest.substr(2);
    const std::size_t slash = rest.find('/');
    parts.authority = rest.substr(0, slash);
    parts.path = slash == std::string_view::npos ? std::string_view{} : rest.substr(slash);
  } else {
    parts.path = rest;
  }
  return parts;
}

struct query_values {
  std::optional<value_source> rank, world_size;
};

inline query_values parse_query(std::string_view query, std::string_view url) {
  query_values values;
  while (!query.empty()) {
    const std::size_t amp = query.find('&');
    const std::string_view item = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view{} : query.substr(amp + 1);
    if (item.empty()) continue;  // "?rank=0&" and "a&&b" are harmless
    const std::size_t eq = item.find('=');
    const std::string_view name = item.substr(0, eq);
    std::optional<value_source>* slot = nullptr;
    if (name == "rank")
      slot = &values.rank;
    else if (name == "world_size")
      slot = &values.world_size;
    else
      throw_init_error(url, name, "only the query parameters rank and world_size", in_quotes(item),
                       "unknown query parameter " + in_quotes(name));
    if (eq == std::string_view::npos)
      throw_init_error(url, name, std::string(name) + "=<integer>", in_quotes(item),
                       "query parameter " + std::string(name) + " has no value");
    if (slot->has_value())
      throw_init_error(url, name, std::string(name) + " at most once",
                       (*slot)->describe() + " and " + in_quotes(item),
                       "query parameter " + std::string(name) + " appears twice");
    *slot = value_source{value_origin::query, std::string(name), std::string(item.substr(eq + 1))};
  }
  return values;
}

// Code and query string are both the user's explicit choice, so neither
inline void parse_tcp_authority(init_spec& spec, std::string_view authority, std::string_view url) {
  constexpr const char* example = "tcp://host:port, e.g. tcp://10.0.0.1:29500";
  if (authority.empty())
    throw_init_error(url, "host", example, in_quotes(url), "the host is empty");
  if (authority.find('@') != std::string_view::npos)
    throw_init_error(url, "host", example, in_quotes(authority),
                     "user names ('user@') are not supported");
  std::string_view host, rest;
  if (authority.front() == '[') {
    const std::size_t close = authority.find(']');
    if (close == std::string_view::npos)
      throw_init_error(url, "host", "tcp://[IPv6]:port, e.g. tcp://[::1]:29500",
                       in_quotes(authority), "missing ']' after the IPv6 address");
    host = authority.substr(1, close - 1);
    rest = authority.substr(close + 1);
    if (!is_ipv6_literal(host))
      throw_init_error(url, "host", "an IPv6 address inside the brackets, e.g. [::1]",
                       in_quotes(host), "not a valid IPv6 address");
    if (!rest.empty() && rest.front() != ':')
      throw_init_error(url, "port", "':' and the port after ']'", in_quotes(rest),
                       "write tcp://[" + std::string(host) + "]:PORT");
  } else {
    const std::size_t colon = authority.find(':');
    host = authority.substr(0, colon);
    rest = colon == std::string_view::npos ? std::string_view{} : authority.substr(colon);
    if (rest.find(':', 1) != std::string_view::npos)
      throw_init_error(url, "host", "tcp://[IPv6]:port, e.g. tcp://[::1]:29500",
                       in_quotes(authority), "an IPv6 address must be written in brackets");
    if (host.empty()) throw_init_error(url, "host", example, in_quotes(url), "the host is empty");
    if (!is_host_name(host))
      throw_init_error(url, "host", example, in_quotes(host),
                       "a host name may only hold letters, digits, '-', '.' and '_'");
  }
  if (rest.empty())
    throw_init_error(url, "port", example, in_quotes(url),
                     "the port is missing; every rank must know where rank 0 listens");
  spec.host = std::string(host);
  spec.port = checked_port({value_origin::url, "port", std::string(rest.substr(1))}, url);
}

}  // namespace dcomm::init
