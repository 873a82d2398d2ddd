// The flight recorder: each rank's last operations, always on, dumped when
// a call times out, loses a peer or is aborted (to DCOMM_TRACE_DIR), and on
// demand (communicator::dump_trace). What it answers after the fact: which
// call each rank was in, which had ended, and when.
//
// Cost: a fixed ring of slots made once (DCOMM_TRACE_BUFFER entries,
// rounded up to a power of two; default 1024; 0 turns it off), no allocation per operation. An
// operation takes the next slot (one atomic add) and writes it with relaxed stores; its start and
// end update it in place. A dump copies the ring while operations go on:
// each slot carries its operation's id, cleared while the slot is
// rewritten and published last, so a copy that raced a rewrite is dropped
// rather than mixed (a seqlock).
//
// The dump (format "dcomm-flight-recorder/1", JSON, one file per rank):
//   { "format": "dcomm-flight-recorder/1", "rank": 0, "world_size": 4, "pid": 1234,
//     "reason": "timeout in all_reduce", "clock": "steady_ns", "dumped_ns": 81234,
//     "groups": [ {"id": "0x0", "name": "the world group", "ranks": [0, 1, 2, 3]}, ... ],
//     "ops": [ {"id": 1, "group": "0x0", "seq": 0, "op": "all_reduce", "collective": true,
//               "dtype": "float32", "count": 1024, "peer": -1, "algorithm": "automatic",
//               "state": "done", "queued_ns": 81000, "ended_ns": 81100, "error": "",
//               "transport": "shm", "ran": "shared_memory", "last_caller": 2,
//               "last_caller_after_ns": 5200, "self_after_ns": 0}, ... ] }
// a group's "ranks" are its members' world ranks, in group rank order;
// ops oldest first; "seq" is a collective's sequence number in its group,
// a send or receive's tag; "peer" the root, or the peer (group ranks), -1
// where there is none; "state" queued (accepted, not yet running on the
// backend), started, done or failed (then "error" names the code);
// times on the steady clock in nanoseconds (ended_ns read coarsely, to
// the clock's last tick; 0 until the end). Once an operation ends, its
// backend says (op_report) which transports carried it ("none": no data
// moved; "tcp", "shm", "shm+tcp", "nccl") and which algorithm ran
// ("automatic": not said); a collective whose messages told of the other
// ranks' calls names the world rank that called it last and how long
// after the first rank it and this rank called (trace/stragglers.hpp;
// last_caller -1 and no times where not known).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "dcomm/backend.hpp"
#include "dcomm/detail/clock.hpp"
#include "dcomm/detail/json_text.hpp"
#include "dcomm/dtype.hpp"
#include "dcomm/error.hpp"

namespace dcomm::trace {

enum class op_phase : std::uint8_t { queued, started, done, failed };

constexpr std::string_view name(op_phase p) noexcept {
  switch (p) {
    case op_phase::queued:
      return "queued";
    case op_phase::started:
      return "started";
    case op_phase::done:
      return "done";
    case op_phase::failed:
      return "failed";
  }
  return "?";
}

// What the front end knows of an operation when it accepts it.
struct op_brief {
  bool collective = true;
  dtype type = dtype::uint8;
  std::size_t count = 0;
  int peer = -1;  // root or peer (group rank); -1: none
};

// One operation as a dump sees it.
struct op_record {
  std::uint64_t id = 0;  // this rank's running number, from 1
  std::uint64_t group = 0;
  std::uint64_t seq = 0;
  const char* operation = "";
  op_brief brief{};
  dcomm::algorithm algorithm = dcomm::algorithm::automatic;
  op_phase phase = op_phase::queued;
  int error = 0;  // a failed operation's errc, 0 if it was not a dcomm::error
  std::int64_t queued_ns = 0, ended_ns = 0;
  // What the backend said once it ended (op_report).
  transports carried{};
  dcomm::algorithm ran = dcomm::algorithm::automatic;
  int last_caller = -1;                              // world rank; -1: not known
  std::int64_t first_call_ns = 0, last_call_ns = 0;  // when last_caller >= 0
};

inline std::int64_t steady_ns(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// The steady clock read cheaply (an operation's end needs no more to say
// when it ended; its start reuses the time its deadline was taken from).
using detail::coarse_steady_ns;

// Where a failure's dump goes: DCOMM_TRACE_DIR/dcomm-trace-rank<r>.json,
// or nowhere when the variable is unset.
inline std::string failure_dump_path(int rank) {
  const char* dir = std::getenv("DCOMM_TRACE_DIR");
  if (!dir || !*dir) return {};
  return std::string(dir) + "/dcomm-trace-rank" + std::to_string(rank) + ".json";
}

// Where a dump made after a failure's goes (flight_recorder::dump_to_trace_dir):
// DCOMM_TRACE_DIR/dcomm-trace-rank<r>-later.json, or nowhere.
inline std::string later_dump_path(int rank) {
  const char* dir = std::getenv("DCOMM_TRACE_DIR");
  if (!dir || !*dir) return {};
  return std::string(dir) + "/dcomm-trace-rank" + std::to_string(rank) + "-later.json";
}

class flight_recorder {
 public:
  static constexpr std::size_t default_capacity = 1024;

  // Rounded up to a power of two (a slot is found by a mask, not a
  // division); 0 records nothing (to measure what recording costs).
  explicit flight_recorder(std::size_t capacity = capacity_from_environment())
      : slots_(capacity ? std::bit_ceil(capacity) : 0), mask_(capacity ? slots_.size() - 1 : 0) {}
  flight_recorder(const flight_recorder&) = delete;
  flight_recorder& operator=(const flight_recorder&) = delete;

  // DCOMM_TRACE_BUFFER, else the default.
  static std::size_t capacity_from_environment() {
    if (const char* v = std::getenv("DCOMM_TRACE_BUFFER")) {
      char* end = nullptr;
      const unsigned long long n = std::strtoull(v, &end, 10);
      if (end != v && *end == '\0' && n <= (1u << 24)) return static_cast<std::size_t>(n);
    }
    return default_capacity;
  }
  std::size_t capacity() const { return slots_.size(); }

  // Names a group in dumps, with its members (world ranks; once per group made).
  void name_group(std::uint64_t id, std::string name, std::vector<int> ranks) {
    std::lock_guard lock(names_mutex_);
    names_[id] = group_entry{std::move(name), std::move(ranks)};
  }

  // An accepted operation: its id, for started() and ended().
  std::uint64_t queued(std::uint64_t group, std::uint64_t seq, const char* operation,
                       const op_brief& b, dcomm::algorithm a, std::int64_t now_ns) {
    if (slots_.empty()) return 0;
    const std::uint64_t id = next_.fetch_add(1, std::memory_order_relaxed) + 1;
    slot& s = at(id);
    s.id.store(0, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    s.group.store(group, std::memory_order_relaxed);
    s.seq.store(seq, std::memory_order_relaxed);
    s.operation.store(operation, std::memory_order_relaxed);
    s.count.store(b.count, std::memory_order_relaxed);
    s.shape.store(pack_shape(b, a), std::memory_order_relaxed);
    s.outcome.store(pack_outcome(op_phase::queued, 0), std::memory_order_relaxed);
    s.queued_ns.store(now_ns, std::memory_order_relaxed);
    s.ended_ns.store(0, std::memory_order_relaxed);
    s.report.store(0, std::memory_order_relaxed);
    s.id.store(id, std::memory_order_release);
    return id;
  }
  void started(std::uint64_t id) { set_outcome(id, op_phase::started, 0, 0); }
  // `error`: a failed operation's errc, 0 if it was not a dcomm::error;
  // `r`: what the backend said of it.
  void ended(std::uint64_t id, bool failed, int error, std::int64_t now_ns,
             const op_report& r = op_report{}) {
    if (id == 0) return;
    slot& s = at(id);
    if (s.id.load(std::memory_order_relaxed) != id) return;  // the ring went round
    const bool known = r.arrivals.others && r.arrivals.known();
    s.report.store(static_cast<std::uint64_t>(r.carried.bits) |
                       static_cast<std::uint64_t>(static_cast<std::uint8_t>(r.ran)) << 8 |
                       static_cast<std::uint64_t>(
                           static_cast<std::uint32_t>(known ? r.arrivals.last_rank + 1 : 0))
                           << 16,
                   std::memory_order_relaxed);
    s.first_call_ns.store(known ? r.arrivals.first_ns : 0, std::memory_order_relaxed);
    s.last_call_ns.store(known ? r.arrivals.last_ns : 0, std::memory_order_relaxed);
    set_outcome(id, failed ? op_phase::failed : op_phase::done, error, now_ns);
  }

  // One operation's record, if the ring still holds it whole.
  std::optional<op_record> record(std::uint64_t id) const {
    op_record r;
    if (id == 0 || slots_.empty() || !read(id, r)) return std::nullopt;
    return r;
  }

  // The recorded operations, oldest first (those being rewritten left out).
  std::vector<op_record> snapshot() const {
    std::vector<op_record> out;
    if (slots_.empty()) return out;
    const std::uint64_t last = next_.load(std::memory_order_acquire);
    const std::uint64_t first = last > slots_.size() ? last - slots_.size() + 1 : 1;
    out.reserve(static_cast<std::size_t>(last - first + 1));
    for (std::uint64_t id = first; id <= last && id != 0; ++id) {
      op_record r;
      if (read(id, r)) out.push_back(r);
    }
    return out;
  }

  // The dump (format above).
  std::string dump_json(int rank, int world_size, std::string_view reason) const {
    const auto ops = snapshot();
    std::map<std::uint64_t, group_entry> names;
    {
      std::lock_guard lock(names_mutex_);
      names = names_;
    }
    std::ostringstream j;
    j << "{\"format\": \"dcomm-flight-recorder/1\", \"rank\": " << rank
      << ", \"world_size\": " << world_size << ", \"pid\": " << ::getpid() << ", \"reason\": ";
    quoted(j, reason);
    j << ", \"clock\": \"steady_ns\", \"dumped_ns\": "
      << steady_ns(std::chrono::steady_clock::now()) << ",\n \"groups\": [";
    bool first = true;
    for (const auto& [id, g] : names) {
      j << (first ? "" : ", ") << "{\"id\": \"" << hex(id) << "\", \"name\": ";
      quoted(j, g.name);
      j << ", \"ranks\": [";
      for (std::size_t i = 0; i < g.ranks.size(); ++i) j << (i ? ", " : "") << g.ranks[i];
      j << "]}";
      first = false;
    }
    j << "],\n \"ops\": [";
    first = true;
    for (const op_record& r : ops) {
      j << (first ? "\n  " : ",\n  ") << "{\"id\": " << r.id << ", \"group\": \"" << hex(r.group)
        << "\", \"seq\": " << r.seq << ", \"op\": ";
      quoted(j, r.operation);
      j << ", \"collective\": " << (r.brief.collective ? "true" : "false") << ", \"dtype\": \""
        << name(r.brief.type) << "\", \"count\": " << r.brief.count
        << ", \"peer\": " << r.brief.peer << ", \"algorithm\": \"" << name(r.algorithm)
        << "\", \"state\": \"" << name(r.phase) << "\", \"queued_ns\": " << r.queued_ns
        << ", \"ended_ns\": " << r.ended_ns << ", \"error\": ";
      quoted(j, r.error ? make_error_code(static_cast<errc>(r.error)).message()
                : r.phase == op_phase::failed ? "not a dcomm::error"
                                              : "");
      j << ", \"transport\": \"" << r.carried.names() << "\", \"ran\": \"" << name(r.ran)
        << "\", \"last_caller\": " << r.last_caller;
      if (r.last_caller >= 0)
        j << ", \"last_caller_after_ns\": " << r.last_call_ns - r.first_call_ns
          << ", \"self_after_ns\": " << std::max<std::int64_t>(r.queued_ns - r.first_call_ns, 0);
      j << "}";
      first = false;
    }
    j << "\n]}\n";
    return j.str();
  }

  // A dump the process makes on its own, to DCOMM_TRACE_DIR (none where it
  // is unset): a failed call's (`failure`), or SIGUSR1's. The first
  // failure's goes to failure_dump_path and stays there: its reason is the
  // message that located the culprit. A dump after it (SIGUSR1 from
  // dcomm-run to a rank that failed and still runs, another failure) goes
  // to later_dump_path; dcomm-trace reads both. Before any failure,
  // SIGUSR1's goes to failure_dump_path. Throws as dump() does.
  void dump_to_trace_dir(int rank, int world_size, std::string_view reason, bool failure) {
    const std::string first = failure_dump_path(rank);
    if (first.empty()) return;
    std::lock_guard lock(dump_mutex_);  // a failure's and a signal's at once: in turn
    const bool after_failure = failure_dumped_;
    if (failure) failure_dumped_ = true;
    dump(after_failure ? later_dump_path(rank) : first, rank, world_size, reason);
  }

  // Writes the dump to `path` (replaced whole: written beside it, then
  // renamed). Throws dcomm::error(system_error) naming the path.
  void dump(const std::string& path, int rank, int world_size, std::string_view reason) const {
    const std::string json = dump_json(rank, world_size, reason);
    const std::string temporary = path + ".tmp." + std::to_string(::getpid());
    {
      std::ofstream f(temporary, std::ios::binary | std::ios::trunc);
      f << json;
      f.flush();
      if (!f)
        throw error(errc::system_error, {.operation = "dump_trace",
                                         .rank = rank,
                                         .detail = "could not write the trace to " + temporary});
    }
    if (std::rename(temporary.c_str(), path.c_str()) != 0) {
      const int e = errno;
      std::remove(temporary.c_str());
      throw error(errc::system_error, {.operation = "dump_trace",
                                       .rank = rank,
                                       .detail = "could not rename the trace to " + path + ": " +
                                                 std::generic_category().message(e)});
    }
  }

 private:
  // Slot `id` copied whole into r; false if it is being rewritten (or was).
  bool read(std::uint64_t id, op_record& r) const {
    const slot& s = at(id);
    if (s.id.load(std::memory_order_acquire) != id) return false;
    r.id = id;
    r.group = s.group.load(std::memory_order_relaxed);
    r.seq = s.seq.load(std::memory_order_relaxed);
    r.operation = s.operation.load(std::memory_order_relaxed);
    r.brief.count = s.count.load(std::memory_order_relaxed);
    unpack_shape(s.shape.load(std::memory_order_relaxed), r);
    const std::uint64_t o = s.outcome.load(std::memory_order_relaxed);
    r.phase = static_cast<op_phase>(o & 0xff);
    r.error = static_cast<int>(o >> 8);
    r.queued_ns = s.queued_ns.load(std::memory_order_relaxed);
    r.ended_ns = s.ended_ns.load(std::memory_order_relaxed);
    const std::uint64_t said = s.report.load(std::memory_order_relaxed);
    r.carried.bits = static_cast<std::uint8_t>(said & 0xff);
    r.ran = static_cast<dcomm::algorithm>((said >> 8) & 0xff);
    r.last_caller = static_cast<int>(static_cast<std::uint32_t>(said >> 16)) - 1;
    r.first_call_ns = s.first_call_ns.load(std::memory_order_relaxed);
    r.last_call_ns = s.last_call_ns.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (s.id.load(std::memory_order_relaxed) != id) return false;  // rewritten meanwhile
    if (!r.operation) r.operation = "";
    return true;
  }

  struct alignas(64) slot {
    std::atomic<std::uint64_t> id{0};
    std::atomic<std::uint64_t> group{0}, seq{0}, count{0};
    std::atomic<const char*> operation{nullptr};
    std::atomic<std::uint64_t> shape{0}, outcome{0};
    std::atomic<std::int64_t> queued_ns{0}, ended_ns{0};
    // The backend's report: transports (8 bits), algorithm run (8), last
    // caller + 1 (32); the first and last call's times.
    std::atomic<std::uint64_t> report{0};
    std::atomic<std::int64_t> first_call_ns{0}, last_call_ns{0};
  };

  slot& at(std::uint64_t id) { return slots_[static_cast<std::size_t>(id & mask_)]; }
  const slot& at(std::uint64_t id) const { return slots_[static_cast<std::size_t>(id & mask_)]; }

  void set_outcome(std::uint64_t id, op_phase p, int error, std::int64_t now_ns) {
    if (id == 0) return;  // not recorded
    slot& s = at(id);
    if (s.id.load(std::memory_order_relaxed) != id) return;  // overwritten: the ring went round
    // Never before it was queued (the coarse clock lags the precise one).
    if (now_ns)
      s.ended_ns.store(std::max(now_ns, s.queued_ns.load(std::memory_order_relaxed)),
                       std::memory_order_relaxed);
    s.outcome.store(pack_outcome(p, error), std::memory_order_relaxed);
  }

  static std::uint64_t pack_outcome(op_phase p, int error) {
    return static_cast<std::uint64_t>(p) | (static_cast<std::uint64_t>(error & 0xffff) << 8);
  }
  static std::uint64_t pack_shape(const op_brief& b, dcomm::algorithm a) {
    return static_cast<std::uint64_t>(static_cast<std::uint32_t>(b.peer)) |
           static_cast<std::uint64_t>(static_cast<std::uint8_t>(b.type)) << 32 |
           static_cast<std::uint64_t>(static_cast<std::uint8_t>(a)) << 40 |
           static_cast<std::uint64_t>(b.collective ? 1 : 0) << 48;
  }
  static void unpack_shape(std::uint64_t v, op_record& r) {
    r.brief.peer = static_cast<int>(static_cast<std::uint32_t>(v & 0xffffffffu));
    r.brief.type = static_cast<dtype>((v >> 32) & 0xff);
    r.algorithm = static_cast<dcomm::algorithm>((v >> 40) & 0xff);
    r.brief.collective = ((v >> 48) & 1) != 0;
  }

  static std::string hex(std::uint64_t v) {
    char b[24];
    std::snprintf(b, sizeof b, "0x%llx", static_cast<unsigned long long>(v));
    return b;
  }
  static void quoted(std::ostringstream& j, std::string_view s) { j << detail::json_quoted(s); }

  std::vector<slot> slots_;
  std::uint64_t mask_;
  std::atomic<std::uint64_t> next_{0};  // ids handed out so far
  struct group_entry {
    std::string name;
    std::vector<int> ranks;
  };
  mutable std::mutex names_mutex_;
  std::map<std::uint64_t, group_entry> names_;
  std::mutex dump_mutex_;        // dump_to_trace_dir's
  bool failure_dumped_ = false;  // by dump_to_trace_dir
};

}  // namespace dcomm::trace
