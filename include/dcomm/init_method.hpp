// Parsing of torch-style init_method URLs (env://, tcp://, file://) and of the
// environment that launchers (torchrun, dcomm-run, mpirun, mpiexec, srun) set.
// Nothing here touches the network: every mistake in a URL or a variable is
// reported here, with the variable and the value, before a rank starts waiting
// for peers that will never come.
#pragma once

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include <dcomm/error.hpp>

namespace dcomm {

enum class init_kind { env, tcp, file };

struct init_spec {
  init_kind kind = init_kind::env;
  std::string url;         // as given, for error messages
  std::string host;        // env:// (MASTER_ADDR) and tcp://; IPv6 without brackets, e.g. "::1"
  std::uint16_t port = 0;  // env:// (MASTER_PORT) and tcp://
  std::string path;        // file://
  int rank = -1;
  int world_size = -1;
  std::optional<int> local_rank, local_world_size;
  // Where the rank came from: "code", "query", "RANK/WORLD_SIZE", "OpenMPI",
  // "MPICH/Hydra" or "Slurm". world_size comes from the same place unless it
  // was given separately (e.g. world_size in code, rank from the environment).
  std::string launcher;

  // "tcp://host:port" (IPv6 host in brackets) or "file:///path", for messages.
  std::string address() const {
    if (kind == init_kind::file) return "file://" + path;
    const bool ipv6 = host.find(':') != std::string::npos;
    return "tcp://" + (ipv6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
  }
};

// Returns the value of an environment variable, or nullopt when it is unset.
// An empty env_lookup stands for an empty environment.
using env_lookup = std::function<std::optional<std::string>(std::string_view name)>;

// Reads the real process environment. Like ::getenv, not safe against a
// concurrent setenv in another thread.
inline env_lookup process_environment() {
  return [](std::string_view name) -> std::optional<std::string> {
    const char* value = std::getenv(std::string(name).c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

namespace detail {

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

// A launcher family: the variables one launcher sets for every process.
struct launcher_family {
  std::string_view name;
  std::string_view rank_var;
  std::string_view size_var;
  std::string_view local_rank_var;
  std::string_view local_size_var;  // empty: read another way (Slurm)
};

// The order is the detection order: torchrun/dcomm-run run inside mpirun or
// srun allocations and must win over them, and mpirun inside an srun
// allocation must win over Slurm, whose variables leak into everything the
// batch script starts.
inline constexpr launcher_family torchrun_family{"RANK/WORLD_SIZE", "RANK", "WORLD_SIZE",
                                                 "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
inline constexpr launcher_family launcher_families[] = {
    torchrun_family,
    {"OpenMPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"MPICH/Hydra", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    {"Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", ""},
};

// Slurm writes per-node task counts as "2" or "2(x3)" (2 tasks on each of 3
// nodes), and as "2(x2),1" when nodes differ; only a count that is the same on
// every node is a local world size, so anything else is left unset rather
// than failing a job that Slurm itself accepted.
inline std::optional<int> parse_slurm_tasks_per_node(std::string_view text) {
  int count = 0;
  const char* const last = text.data() + text.size();
  const auto [end, ec] = std::from_chars(text.data(), last, count);
  if (ec != std::errc{} || count < 1) return std::nullopt;
  if (end == last) return count;
  std::string_view rest(end, static_cast<std::size_t>(last - end));
  if (rest.size() < 4 || rest.substr(0, 2) != "(x" || rest.back() != ')') return std::nullopt;
  rest = rest.substr(2, rest.size() - 3);
  int nodes = 0;
  const auto [nodes_end, nodes_ec] = std::from_chars(rest.data(), rest.data() + rest.size(), nodes);
  if (nodes_ec != std::errc{} || nodes_end != rest.data() + rest.size() || nodes < 1)
    return std::nullopt;
  return count;
}

// SLURM_NTASKS_PER_NODE is only set with --ntasks-per-node; the step's own
// layout is the fallback.
inline std::optional<sourced_int> slurm_local_size(const env_lookup& env) {
  for (std::string_view name : {"SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE"}) {
    auto text = lookup(env, name);
    if (!text) continue;
    if (auto count = parse_slurm_tasks_per_node(*text))
      return sourced_int{*count, {value_origin::environment, std::string(name), *text}};
  }
  return std::nullopt;
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

inline std::string checked_master_addr(std::string_view value, std::string_view url) {
  const value_source source{value_origin::environment, "MASTER_ADDR", std::string(value)};
  std::string_view host = value;
  const bool bracketed = host.size() >= 2 && host.front() == '[' && host.back() == ']';
  if (bracketed) host = host.substr(1, host.size() - 2);
  if (host.empty())
    throw_init_error(url, "MASTER_ADDR", "the host name or IP address of rank 0", source.describe(),
                     "MASTER_ADDR is empty");
  if (host.find(':') != std::string_view::npos || bracketed) {
    if (is_ipv6_literal(host)) return std::string(host);
    const bool host_port = !bracketed && host.find(':') == host.rfind(':');
    throw_init_error(url, "MASTER_ADDR", "the host name or IP address of rank 0", source.describe(),
                     host_port ? "this looks like host:port; put the port in MASTER_PORT"
                               : "not a valid IPv6 address");
  }
  if (!is_host_name(host))
    throw_init_error(url, "MASTER_ADDR", "the host name or IP address of rank 0", source.describe(),
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
// silently overrides the other.
inline std::optional<sourced_int> explicit_value(std::optional<int> code,
                                                 const std::optional<value_source>& query,
                                                 std::string_view name, std::string_view meaning,
                                                 std::string_view url) {
  std::optional<sourced_int> from_code, from_query;
  if (code)
    from_code = sourced_int{*code, {value_origin::code, std::string(name), std::to_string(*code)}};
  if (query) from_query = sourced_int{parse_int(*query, url, meaning), *query};
  if (from_code && from_query && from_code->value != from_query->value)
    throw_init_error(url, name, "the same " + std::string(name) + " in code and in the URL",
                     from_code->source.describe() + " but " + from_query->source.describe(),
                     "give " + std::string(name) + " in one place only");
  return from_code ? from_code : from_query;
}

inline std::string_view origin_launcher(const sourced_int& v, std::string_view family) {
  switch (v.source.origin) {
    case value_origin::code:
      return "code";
    case value_origin::query:
      return "query";
    case value_origin::url:
    case value_origin::environment:
      break;
  }
  return family;
}

inline const launcher_family* detect_family(const env_lookup& env, bool need_rank) {
  for (const launcher_family& family : launcher_families)
    if (lookup(env, family.rank_var)) return &family;
  // The rank was given explicitly and only the size is missing: any
  // launcher that says how many processes it started will do.
  if (!need_rank)
    for (const launcher_family& family : launcher_families)
      if (lookup(env, family.size_var)) return &family;
  return nullptr;
}

inline void resolve_local(init_spec& spec, const env_lookup& env, const launcher_family* family,
                          std::string_view url) {
  if (family == nullptr) {
    // Rank and size came from code or the URL: take the local layout from
    // whichever launcher started this process.
    family = &torchrun_family;
    for (const launcher_family& f : launcher_families)
      if (lookup(env, f.local_rank_var)) {
        family = &f;
        break;
      }
  }
  std::optional<sourced_int> local_rank =
      env_int(env, family->local_rank_var, url, "local rank (index of this process on its node)");
  if (!local_rank) local_rank = env_int(env, "LOCAL_RANK", url, "local rank");
  std::optional<sourced_int> local_size =
      family->local_size_var.empty()
          ? slurm_local_size(env)
          : env_int(env, family->local_size_var, url, "local world size (processes per node)");
  if (!local_size) local_size = env_int(env, "LOCAL_WORLD_SIZE", url, "local world size");

  if (local_rank) check_rank_value(*local_rank, url, "local rank");
  if (local_size) check_size_value(*local_size, url, "local world size");
  if (local_rank && local_size)
    check_rank_below_size(*local_rank, *local_size, url, "local rank", "local world size");
  if (local_rank) spec.local_rank = local_rank->value;
  if (local_size) spec.local_world_size = local_size->value;
}

inline void resolve_ranks(init_spec& spec, std::optional<int> code_rank,
                          std::optional<int> code_size, const query_values& query,
                          const env_lookup& env, std::string_view url) {
  std::optional<sourced_int> rank =
      explicit_value(code_rank, query.rank, "rank", "rank (0..world_size-1)", url);
  std::optional<sourced_int> size = explicit_value(code_size, query.world_size, "world_size",
                                                   "world size (number of ranks)", url);
  if (rank) check_rank_value(*rank, url, "rank");
  if (size) check_size_value(*size, url, "world size");

  const launcher_family* family = nullptr;
  if (spec.kind == init_kind::env && (!rank || !size)) {
    family = detect_family(env, !rank);
    if (family == nullptr)
      throw_init_error(
          url, !rank ? "RANK" : "WORLD_SIZE",
          std::string(!rank ? "the rank" : "the world size") +
              " from a launcher (RANK/WORLD_SIZE, OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE, "
              "PMI_RANK/PMI_SIZE or SLURM_PROCID/SLURM_NTASKS), from code, or from the URL",
          "none of them set",
          "start the program with torchrun, dcomm-run, mpirun, mpiexec or srun, or pass rank "
          "and world_size in code or as env://?rank=R&world_size=N");
    if (!rank) {
      rank = env_int(env, family->rank_var, url, "rank (0..world_size-1)");
      check_rank_value(*rank, url, "rank");
    }
    if (!size) {
      size = env_int(env, family->size_var, url, "world size (number of ranks)");
      if (!size)
        throw_init_error(
            url, family->size_var,
            std::string(family->size_var) + " next to " + std::string(family->rank_var),
            std::string(family->rank_var) + " is set but " + std::string(family->size_var) +
                " is not",
            "env:// takes the rank and the world size from the same launcher (" +
                std::string(family->name) + "); set " + std::string(family->size_var) +
                " or pass world_size in code");
      check_size_value(*size, url, "world size");
    }
  }
  if (!rank || !size) {
    const std::string_view scheme = spec.kind == init_kind::tcp ? "tcp://" : "file://";
    const std::string_view missing = !rank ? "rank" : "world_size";
    throw_init_error(url, missing, "rank and world_size", std::string(missing) + " not given",
                     "pass rank and world_size in code (parse_init_method(url, rank, "
                     "world_size)) or in the query string (" +
                         std::string(scheme) + "...?rank=R&world_size=N)");
  }
  check_rank_below_size(*rank, *size, url, "rank", "world size");

  spec.rank = rank->value;
  spec.world_size = size->value;
  spec.launcher = origin_launcher(*rank, family != nullptr ? family->name : "");
  resolve_local(spec, env, family, url);
}

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

}  // namespace detail

// Turns an init_method URL plus the launcher's environment into an
// init_spec, or throws dcomm::error (errc::invalid_argument) naming the URL
// part or variable to fix. rank and world_size, when given, win over the
// environment; if the URL's query string also gives them they must agree.
inline init_spec parse_init_method(std::string_view url, std::optional<int> rank = {},
                                   std::optional<int> world_size = {},
                                   const env_lookup& env = process_environment()) {
  const detail::url_parts parts = detail::split_url(url);
  init_spec spec;
  spec.url = std::string(url);

  if (parts.scheme == "env") {
    spec.kind = init_kind::env;
    if (!parts.has_authority || !parts.authority.empty() || !parts.path.empty())
      detail::throw_init_error(
          url, "init_method", "env:// with nothing after it but an optional ?query",
          detail::in_quotes(url),
          "env:// reads the address from MASTER_ADDR and MASTER_PORT; to put it in the URL, "
          "use tcp://host:port");
  } else if (parts.scheme == "tcp") {
    spec.kind = init_kind::tcp;
    if (!parts.has_authority)
      detail::throw_init_error(url, "init_method", "tcp://host:port", detail::in_quotes(url),
                               "write two slashes after tcp:");
    if (!parts.path.empty() && parts.path != "/")
      detail::throw_init_error(url, "init_method", "tcp://host:port with no path",
                               detail::in_quotes(parts.path), "remove the path after the port");
    detail::parse_tcp_authority(spec, parts.authority, url);
  } else if (parts.scheme == "file") {
    spec.kind = init_kind::file;
    constexpr std::string_view example = "file:///absolute/path, e.g. file:///tmp/dcomm_init";
    if (parts.has_authority && !parts.authority.empty() && parts.authority != "localhost")
      detail::throw_init_error(
          url, "path", std::string(example), detail::in_quotes(url),
          "file:// is followed by an absolute path, so it takes three slashes; '" +
              std::string(parts.authority) + "' was read as a host name");
    if (parts.path.empty())
      detail::throw_init_error(url, "path", std::string(example), detail::in_quotes(url),
                               "the path is missing");
    if (parts.path.front() != '/')
      detail::throw_init_error(url, "path", std::string(example), detail::in_quotes(parts.path),
                               "the path must be absolute: every rank resolves it from its "
                               "own working directory");
    if (parts.path.back() == '/')
      detail::throw_init_error(url, "path", std::string(example), detail::in_quotes(parts.path),
                               "the path names a directory; name a file inside it");
    spec.path = std::string(parts.path);
  } else {
    detail::throw_init_error(url, "init_method", std::string(detail::supported_init_methods),
                             detail::in_quotes(url),
                             "unknown scheme " + detail::in_quotes(parts.scheme + "://"));
  }

  const detail::query_values query = detail::parse_query(parts.query, url);

  if (spec.kind == init_kind::env) {
    const auto addr = detail::lookup(env, "MASTER_ADDR");
    const auto port = detail::lookup(env, "MASTER_PORT");
    for (auto [name, value] : {std::pair{"MASTER_ADDR", &addr}, std::pair{"MASTER_PORT", &port}})
      if (!*value)
        detail::throw_init_error(url, name, "MASTER_ADDR and MASTER_PORT in the environment",
                                 std::string(name) + " unset",
                                 "env:// needs MASTER_ADDR (host of rank 0) and MASTER_PORT "
                                 "(port it listens on); set " +
                                     std::string(name) + " or use tcp://host:port");
    spec.host = detail::checked_master_addr(*addr, url);
    spec.port =
        detail::checked_port({detail::value_origin::environment, "MASTER_PORT", *port}, url);
  }

  detail::resolve_ranks(spec, rank, world_size, query, env, url);
  return spec;
}

}  // namespace dcomm
