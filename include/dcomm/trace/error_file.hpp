// TorchElastic's error file. torchrun (and the agent Kubeflow's PyTorchJob
// runs) gives each worker a path in TORCHELASTIC_ERROR_FILE and, when the
// worker fails, prints that file's message in its failure summary, where it
// shows `error_file: <N/A>` and only an exit code or signal otherwise.
// dcomm writes the file where the variable is set (dcomm-run sets it too,
// and prints the message of the rank it blames):
//   - at the first failure in the process of init_process_group, or of an
//     operation that ends a job (timeout, peer_lost, mismatch, aborted): a
//     program that catches the dcomm::error and returns 1 is still explained;
//   - on an uncaught exception (std::terminate, once init_process_group has
//     run), replacing it: that is what ended the process.
// The format is torch's (torch/distributed/elastic/multiprocessing/errors):
//   {"message": {"message": "<what()>", "extraInfo": {"timestamp": "<unix s>"}}}
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <string>
#include <string_view>

#include "dcomm/detail/json_text.hpp"

namespace dcomm::trace {

inline constexpr const char* error_file_variable = "TORCHELASTIC_ERROR_FILE";

// The file's JSON for `message`.
inline std::string error_file_json(std::string_view message) {
  return "{\"message\": {\"message\": " + detail::json_quoted(message) +
         ", \"extraInfo\": {\"timestamp\": \"" +
         std::to_string(static_cast<long long>(std::time(nullptr))) + "\"}}}\n";
}

// Writes `message` to TORCHELASTIC_ERROR_FILE (whole: beside it, then
// renamed), if the variable is set. Never throws: the failure it explains
// is what the program reports; false if nothing was written.
inline bool write_error_file(std::string_view message) noexcept {
  try {
    const char* path = std::getenv(error_file_variable);
    if (!path || !*path) return false;
    const std::string json = error_file_json(message);
    const std::string temporary = std::string(path) + ".tmp." + std::to_string(::getpid());
    const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return false;
    std::size_t done = 0;
    while (done < json.size()) {
      const ssize_t n = ::write(fd, json.data() + done, json.size() - done);
      if (n <= 0) break;
      done += static_cast<std::size_t>(n);
    }
    const bool written = ::close(fd) == 0 && done == json.size();
    if (!written || std::rename(temporary.c_str(), path) != 0) {
      ::unlink(temporary.c_str());
      return false;
    }
    return true;
  } catch (...) {
    return false;
  }
}

// The first failure of the process (see the top): later ones are effects.
inline void note_first_failure(std::string_view message) noexcept {
  static std::atomic<bool> noted{false};
  if (!std::getenv(error_file_variable) || noted.exchange(true)) return;
  write_error_file(message);
}

// From now on, an uncaught exception's what() is written before the
// previous terminate handler (by default: abort) runs. Once per process,
// and only where the variable is set.
inline void write_error_file_on_terminate() noexcept {
  static std::atomic<bool> installed{false};
  if (!std::getenv(error_file_variable) || installed.exchange(true)) return;
  static std::terminate_handler previous = nullptr;
  previous = std::set_terminate([] {
    if (auto e = std::current_exception()) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& x) {
        write_error_file(x.what());
      } catch (...) {
        write_error_file("an uncaught exception that is not a std::exception");
      }
    }
    if (previous) previous();
    std::abort();
  });
}

}  // namespace dcomm::trace
