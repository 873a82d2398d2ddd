// dcomm errors: one error_code category for everything that can go wrong, and
// one exception type whose message names what a user needs to fix the problem
// (rank, operation, key, address, expected vs seen).
#pragma once

#include <exception>
#include <optional>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

namespace dcomm {

enum class errc {
  timeout = 1,       // a deadline passed before the peers/keys showed up
  peer_lost,         // a peer disconnected or died
  invalid_argument,  // bad input, detected before anything was sent
  mismatch,          // ranks disagree (world size, collective call, ...)
  closed,            // the object was closed or destroyed
  address_in_use,    // a port to bind is already taken
  aborted,           // abort() was called
  protocol_error,    // a peer sent bytes that do not follow the protocol
  auth_failed,       // a peer could not prove it holds the job token
  connect_failed,    // could not reach a peer until the deadline
  unsupported,       // this build lacks a feature the call needs
  rank_failed,       // a rank's process failed (spawn, launcher)
  device_error,      // a CUDA or NCCL call failed (dcomm/cuda.hpp, dcomm/nccl.hpp)
  system_error,      // the operating system refused a call (fork, pipe, ...): detail names
                     // the call and errno's text
  remote_error,      // a remote call's function threw on the callee (dcomm/rpc.hpp): detail
                     // holds its message
  revoked,           // the group was revoked (communicator::revoke): peers names the
                     // revoker, detail its reason
};

}  // namespace dcomm

template <>
struct std::is_error_code_enum<dcomm::errc> : std::true_type {};

namespace dcomm {

namespace detail {
class error_category_impl final : public std::error_category {
 public:
  const char* name() const noexcept override { return "dcomm"; }
  std::string message(int ev) const override {
    switch (static_cast<errc>(ev)) {
      case errc::timeout:
        return "timed out";
      case errc::peer_lost:
        return "peer lost";
      case errc::invalid_argument:
        return "invalid argument";
      case errc::mismatch:
        return "mismatch between ranks";
      case errc::closed:
        return "closed";
      case errc::address_in_use:
        return "address in use";
      case errc::aborted:
        return "aborted";
      case errc::protocol_error:
        return "protocol error";
      case errc::auth_failed:
        return "authentication failed";
      case errc::connect_failed:
        return "connection failed";
      case errc::unsupported:
        return "unsupported in this build";
      case errc::rank_failed:
        return "a rank failed";
      case errc::device_error:
        return "device error";
      case errc::system_error:
        return "system call failed";
      case errc::remote_error:
        return "the remote function failed";
      case errc::revoked:
        return "revoked";
    }
    return "unknown dcomm error";
  }
};
}  // namespace detail

inline const std::error_category& error_category() noexcept {
  static const detail::error_category_impl category;
  return category;
}

inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), error_category()};
}

// What went wrong, in the words a user needs. Every field is optional; the
// message lists the ones that are set, in a fixed order.
struct error_context {
  std::string operation{};  // e.g. "tcp_store.get", "rendezvous"
  std::optional<int> rank{};
  std::string peers{};  // e.g. "ranks {3,7}"
  std::string key{};
  std::string address{};
  std::string expected{};
  std::string seen{};
  std::string detail{};
};

namespace detail {
inline std::string format_error(std::error_code code, const error_context& c) {
  std::string m = "dcomm: ";
  m += code.message();
  if (!c.operation.empty()) m += " in " + c.operation;
  if (c.rank) m += " (rank " + std::to_string(*c.rank) + ")";
  if (!c.peers.empty()) m += ", peers " + c.peers;
  if (!c.key.empty()) m += ", key '" + c.key + "'";
  if (!c.address.empty()) m += ", at " + c.address;
  if (!c.expected.empty() || !c.seen.empty())
    m += ": expected " + (c.expected.empty() ? std::string("-") : c.expected) + ", seen " +
         (c.seen.empty() ? std::string("-") : c.seen);
  if (!c.detail.empty()) m += ": " + c.detail;
  return m;
}
}  // namespace detail

namespace detail {
// A set of ranks for messages: "{0,1}", "{1-3,7}" (runs of three or more
// folded), shortened for large worlds.
inline std::string format_ranks(const std::vector<int>& ranks) {
  std::string out = "{";
  std::size_t shown = 0;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (j < i + 2) j = i;  // a pair stays "0,1"
    if (shown++ == 16) {
      out += ",... " + std::to_string(ranks.size() - i) + " more";
      break;
    }
    if (i > 0) out += ",";
    out += std::to_string(ranks[i]);
    if (j > i) out += "-" + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out + "}";
}
}  // namespace detail

class error : public std::system_error {
 public:
  error(errc e, error_context context) : error(make_error_code(e), std::move(context)) {}
  error(std::error_code code, error_context context)
      : std::system_error(code),
        message_(detail::format_error(code, context)),
        context_(std::move(context)) {}

  // std::system_error would append code().message() a second time.
  const char* what() const noexcept override { return message_.c_str(); }
  const error_context& context() const noexcept { return context_; }

 private:
  std::string message_;
  error_context context_;
};

[[noreturn]] inline void throw_error(errc e, error_context context) {
  throw error(e, std::move(context));
}

namespace detail {
// What an exception says, for another error's detail: what() for a
// std::exception.
inline std::string message_of(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}
}  // namespace detail

}  // namespace dcomm
