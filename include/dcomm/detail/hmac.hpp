// Keyed message authentication and nonces for the job-token handshake. Only
// OpenSSL's libcrypto is used, never hand-written crypto: builds without it
// (meson feature 'openssl' disabled) refuse a job token at start-up.
#pragma once

#include <array>
#include <cstdint>
#include <random>
#include <string>
#include <string_view>

#include "dcomm/error.hpp"

#if defined(DCOMM_HAS_OPENSSL)
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#endif

namespace dcomm::detail {

using digest = std::array<unsigned char, 32>;
using nonce = std::array<unsigned char, 32>;

inline constexpr bool have_crypto() noexcept {
#if defined(DCOMM_HAS_OPENSSL)
  return true;
#else
  return false;
#endif
}

// Fails at start-up, before any connection, when a token cannot be honoured.
inline void require_crypto_for(std::string_view token, const char* operation) {
  if (!token.empty() && !have_crypto())
    throw_error(errc::unsupported,
                {.operation = operation,
                 .key = "DCOMM_JOB_TOKEN",
                 .detail = "a job token is set (dcomm-run and dcomm::spawn give their ranks "
                           "one) but this dcomm build has no OpenSSL to check it; build with "
                           "-DDCOMM_HAS_OPENSSL=1 and -lcrypto (Debian: libssl-dev; in Meson the "
                           "feature 'openssl'), or run the job without a token: dcomm-run "
                           "--no-auth, spawn_options{.auth = false}, or DCOMM_JOB_TOKEN unset"});
}

inline nonce make_nonce() {
  nonce n{};
#if defined(DCOMM_HAS_OPENSSL)
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) == 1) return n;
#endif
  // Without a token the nonce only has to differ between connections.
  std::random_device rd;
  for (auto& b : n) b = static_cast<unsigned char>(rd());
  return n;
}

inline digest hmac_sha256([[maybe_unused]] std::string_view key,
                          [[maybe_unused]] std::string_view message) {
  digest out{};
#if defined(DCOMM_HAS_OPENSSL)
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
            reinterpret_cast<const unsigned char*>(message.data()), message.size(), out.data(),
            &len) ||
      len != out.size())
    throw_error(errc::auth_failed, {.operation = "hmac", .detail = "OpenSSL HMAC failed"});
#else
  throw_error(errc::unsupported, {.operation = "hmac", .detail = "built without OpenSSL"});
#endif
  return out;
}

inline bool digest_equal(const digest& a, const digest& b) {
#if defined(DCOMM_HAS_OPENSSL)
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
#else
  unsigned char diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
#endif
}

}  // namespace dcomm::detail
