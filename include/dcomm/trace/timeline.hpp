// The timeline: with DCOMM_TRACE=PATH set, each rank writes every operation
// it made as a Chrome trace event (opens in Perfetto, ui.perfetto.dev, or
// chrome://tracing): where the time goes, call by call, beside the
// program's own work. `dcomm-run --timeline PATH` merges the ranks' files
// into PATH, one track per rank.
//
// Rank r writes PATH with its ".json" ending (if any) replaced by
// "-rank<r>.json". The file is a JSON array of trace events (Chrome's "JSON
// Array Format"):
//   {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rank 0"}}
//   {"name": "dcomm_clock", "ph": "M", "pid": 0,
//    "args": {"steady_ns": 81234, "realtime_ns": 1764040000000000000, "boot_id": "..."}}
//   {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "the world group"}}
//   {"name": "all_reduce", "cat": "collective", "ph": "X", "pid": 0, "tid": 1,
//    "ts": 81.234, "dur": 12.5, "args": {"group": "0x0", "seq": 3, "dtype": "float32",
//    "count": 1024, "bytes": 4096, "peer": -1, "algorithm": "automatic", "state": "done",
//    "transport": "shm", "ran": "shared_memory", "last_caller": 2,
//    "last_caller_after_us": 5.2, "self_after_us": 0.0}}
// "pid" is the rank; "tid" a track per group (collectives) and one more per
// group for its sends and receives; "ts" and "dur" microseconds on the
// steady clock, from the call (when the caller made it) to its end;
// "algorithm" the one asked for, "ran" the one that ran; the last three
// where the call's messages told of the other ranks' calls (the world rank
// that called last, how long after the first rank it and this rank
// called; trace/stragglers.hpp), else last_caller -1. The
// dcomm_clock entry ties the steady clock to the wall clock and the boot:
// ranks with one boot id share the steady clock exactly; others are
// aligned through the wall clock (NTP: to about a millisecond).
//
// Cost: one precise clock read per call (the flight recorder reads the
// coarse one) and a fixed-size entry in a buffer. Entries are formatted
// only when the communicator closes: until then full buffers (8192 calls)
// go to a binary spill file beside the result (PATH's rank file plus
// ".events"), which the close turns into the JSON and removes. A rank that
// dies without closing (SIGKILL, SIGTERM's default action) leaves only that
// spill file: the timeline is for jobs that end.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "dcomm/backend.hpp"
#include "dcomm/dtype.hpp"
#include "dcomm/error.hpp"
#include "dcomm/trace/flight_recorder.hpp"

namespace dcomm::trace {

// One call as the timeline keeps it (written to the spill file as is).
struct timeline_event {
  char operation[24] = {};  // its name (the longest is 17 characters)
  std::uint64_t group = 0;
  std::uint64_t seq = 0;
  std::uint64_t count = 0;
  std::int64_t start_ns = 0, end_ns = 0;  // steady clock
  std::int32_t peer = -1;
  dtype type = dtype::uint8;
  dcomm::algorithm algorithm = dcomm::algorithm::automatic;
  bool collective = true;
  bool failed = false;
  // What the backend said once the call ended (op_report).
  std::uint8_t carried = 0;
  dcomm::algorithm ran = dcomm::algorithm::automatic;
  std::int32_t last_caller = -1;
  std::int64_t first_call_ns = 0, last_call_ns = 0;

  timeline_event() = default;
  timeline_event(const char* op, std::uint64_t g, std::uint64_t s, const op_brief& b,
                 dcomm::algorithm a, std::int64_t start)
      : group(g),
        seq(s),
        count(b.count),
        start_ns(start),
        peer(b.peer),
        type(b.type),
        algorithm(a),
        collective(b.collective) {
    std::strncpy(operation, op, sizeof operation - 1);
  }
};
static_assert(std::is_trivially_copyable_v<timeline_event>);

class timeline {
 public:
  static constexpr std::size_t batch = 8192;  // calls kept before they are spilled

  // Where rank `rank` writes for DCOMM_TRACE=`base`.
  static std::string path_for(std::string_view base, int rank) {
    std::string stem(base);
    if (stem.ends_with(".json")) stem.resize(stem.size() - 5);
    return stem + "-rank" + std::to_string(rank) + ".json";
  }

  // The timeline DCOMM_TRACE asks for; null where it is unset.
  static std::shared_ptr<timeline> from_environment(int rank) {
    const char* base = std::getenv("DCOMM_TRACE");
    if (!base || !*base) return nullptr;
    return std::make_shared<timeline>(path_for(base, rank), rank);
  }

  // Checks that `path` can be written (and makes its spill file). Throws
  // dcomm::error(system_error) naming it.
  timeline(std::string path, int rank) : path_(std::move(path)), rank_(rank) {
    if (std::FILE* probe = std::fopen(path_.c_str(), "w"))
      std::fclose(probe);
    else
      fail("cannot write the timeline to " + path_);
    spill_ = std::fopen(spill_path().c_str(), "w+b");
    if (!spill_) fail("cannot write the timeline's spill file " + spill_path());
    pending_.reserve(batch);
    std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id_;
    steady_at_start_ = steady_ns(std::chrono::steady_clock::now());
    wall_at_start_ = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
  }
  timeline(const timeline&) = delete;
  timeline& operator=(const timeline&) = delete;
  ~timeline() { close(); }

  const std::string& path() const { return path_; }

  // A group's track name (once per group made).
  void name_group(std::uint64_t id, std::string name) {
    std::lock_guard lock(mutex_);
    names_[id] = std::move(name);
  }

  void add(const timeline_event& e) {
    std::lock_guard lock(mutex_);
    if (!spill_) return;
    pending_.push_back(e);
    if (pending_.size() >= batch) spill_locked();
  }

  // Writes the JSON; later calls are not kept. Errors are dropped: the
  // timeline is a by-product, and the close of a communicator cannot fail.
  void close() {
    std::lock_guard lock(mutex_);
    if (!spill_) return;
    spill_locked();
    std::FILE* out = std::fopen(path_.c_str(), "w");
    if (out) {
      write_header(out);
      std::rewind(spill_);
      timeline_event e;
      while (std::fread(&e, sizeof e, 1, spill_) == 1) write_event(out, e);
      std::fputs("\n]\n", out);
      std::fclose(out);
    }
    std::fclose(spill_);
    spill_ = nullptr;
    std::remove(spill_path().c_str());
  }

 private:
  [[noreturn]] void fail(std::string detail) const {
    throw error(errc::system_error,
                {.operation = "DCOMM_TRACE", .rank = rank_, .detail = std::move(detail)});
  }
  std::string spill_path() const { return path_ + ".events"; }

  void spill_locked() {
    if (!pending_.empty())
      std::fwrite(pending_.data(), sizeof(timeline_event), pending_.size(), spill_);
    pending_.clear();
  }

  void write_header(std::FILE* out) const {
    std::fprintf(
        out,
        "[\n{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"args\": {\"name\": "
        "\"rank %d\"}},\n"
        "{\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": %d, \"args\": "
        "{\"sort_index\": %d}},\n"
        "{\"name\": \"dcomm_clock\", \"ph\": \"M\", \"pid\": %d, \"args\": {\"steady_ns\": "
        "%lld, \"realtime_ns\": %lld, \"boot_id\": \"%s\"}}",
        rank_, rank_, rank_, rank_, rank_, static_cast<long long>(steady_at_start_),
        static_cast<long long>(wall_at_start_), escaped(boot_id_).c_str());
  }

  // The track of a group's collectives (odd) or of its sends and receives
  // (the next one), named the first time it is used.
  int track(std::FILE* out, std::uint64_t group, bool collective) {
    auto [it, fresh] = tracks_.try_emplace(group, 2 * static_cast<int>(tracks_.size()) + 1);
    if (fresh) {
      auto n = names_.find(group);
      std::string name = n != names_.end() ? n->second : "group " + hex(group);
      for (int k = 0; k < 2; ++k)
        std::fprintf(out,
                     ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, "
                     "\"args\": {\"name\": \"%s%s\"}}",
                     rank_, it->second + k, escaped(name).c_str(), k ? ": send/recv" : "");
    }
    return it->second + (collective ? 0 : 1);
  }

  void write_event(std::FILE* out, const timeline_event& e) {
    const int tid = track(out, e.group, e.collective);
    std::fprintf(
        out,
        ",\n{\"name\": \"%s\", \"cat\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": "
        "%d, \"ts\": %.3f, \"dur\": %.3f, \"args\": {\"group\": \"%s\", \"seq\": "
        "%llu, \"dtype\": \"%s\", \"count\": %llu, \"bytes\": %llu, \"peer\": %d, "
        "\"algorithm\": \"%s\", \"state\": \"%s\", \"transport\": \"%s\", "
        "\"ran\": \"%s\", \"last_caller\": %d",
        escaped(e.operation).c_str(), e.collective ? "collective" : "point_to_point", rank_, tid,
        static_cast<double>(e.start_ns) / 1e3, static_cast<double>(e.end_ns - e.start_ns) / 1e3,
        hex(e.group).c_str(), static_cast<unsigned long long>(e.seq),
        std::string(name(e.type)).c_str(), static_cast<unsigned long long>(e.count),
        static_cast<unsigned long long>(e.count * size_of(e.type)), e.peer,
        std::string(name(e.algorithm)).c_str(), e.failed ? "failed" : "done",
        transports{e.carried}.names().c_str(), std::string(name(e.ran)).c_str(), e.last_caller);
    if (e.last_caller >= 0)
      std::fprintf(
          out, ", \"last_caller_after_us\": %.3f, \"self_after_us\": %.3f",
          static_cast<double>(e.last_call_ns - e.first_call_ns) / 1e3,
          static_cast<double>(std::max<std::int64_t>(e.start_ns - e.first_call_ns, 0)) / 1e3);
    std::fputs("}}", out);
  }

  static std::string hex(std::uint64_t v) {
    char b[24];
    std::snprintf(b, sizeof b, "0x%llx", static_cast<unsigned long long>(v));
    return b;
  }
  static std::string escaped(std::string_view s) {
    std::string out;
    for (char c : s) {
      if (c == '"' || c == '\\') out += '\\';
      if (static_cast<unsigned char>(c) >= 0x20) out += c;
    }
    return out;
  }

  std::string path_;
  int rank_;
  std::FILE* spill_ = nullptr;
  std::string boot_id_;
  std::int64_t steady_at_start_ = 0, wall_at_start_ = 0;
  std::mutex mutex_;
  std::vector<timeline_event> pending_;
  std::map<std::uint64_t, std::string> names_;
  std::map<std::uint64_t, int> tracks_;
};

}  // namespace dcomm::trace
