// file_store: the store contract, binary safety, timeouts, several instances
// in one process and across processes, crashed and stopped lock holders,
// cleanup and bad paths.
// Size: many small independent cases in one translation unit on purpose: each
// Asio-heavy test file costs about a minute per CI build (three builds), so
// a component's cases share one file rather than split by line count.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <doctest/doctest.h>
#include <dcomm/store/file_store.hpp>

#include "support/deadline.hpp"
#include "support/fork_world.hpp"

namespace {

using namespace std::chrono_literals;
using dcomm::file_store;
using dcomm::store;
namespace file_log = dcomm::store_detail::file_log;

struct temp_dir {
  std::string path;
  temp_dir() {
    std::string tmpl =
        (std::filesystem::temp_directory_path() / "dcomm_file_store_XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = tmpl;
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return path + "/" + name; }
};

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

std::string read_whole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Whether the file is a header followed by nothing but complete records.
bool log_is_clean(const std::string& path) {
  const std::string bytes = read_whole(path);
  if (bytes.size() < file_log::header_size) return false;
  std::string_view rest(bytes);
  rest.remove_prefix(file_log::header_size);
  file_log::record r;
  while (const std::size_t n = file_log::decode(rest, r)) rest.remove_prefix(n);
  return rest.empty();
}

// Opens `path` and takes an open-file-description lock on it, as a store
// writer (F_WRLCK) or reader (F_RDLCK) would; -1 if the lock is taken.
int lock_raw(const std::string& path, short type) {
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return -1;
  struct flock fl {};
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  if (::fcntl(fd, F_OFD_SETLK, &fl) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

void append_raw(int fd, const std::string& bytes) {
  const off_t end = ::lseek(fd, 0, SEEK_END);
  if (::pwrite(fd, bytes.data(), bytes.size(), end) != static_cast<ssize_t>(bytes.size()))
    throw std::runtime_error("pwrite failed");
}

// Publishes a pid for another process of the test, atomically.
void write_pid(const std::string& path) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << ::getpid();
  }
  std::filesystem::rename(tmp, path);
}

pid_t wait_for_pid(const std::string& path, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!exists(path)) {
    if (std::chrono::steady_clock::now() >= deadline)
      throw std::runtime_error("no pid file " + path);
    std::this_thread::sleep_for(1ms);
  }
  pid_t pid = 0;
  std::ifstream(path) >> pid;
  return pid;
}

// The error an operation ends with, if any.
template <typename T>
asio::awaitable<std::optional<dcomm::error>> error_of(asio::awaitable<T> op) {
  std::optional<dcomm::error> caught;
  try {
    co_await std::move(op);
  } catch (const dcomm::error& e) {
    caught = e;
  }
  co_return caught;
}

template <typename T>
std::optional<dcomm::error> sync_error_of(asio::io_context& context, asio::awaitable<T> op) {
  return dcomm::sync_wait(context, error_of(std::move(op)));
}

std::shared_ptr<file_store> open_store(asio::io_context& context, const std::string& path,
                                       int num_workers = -1,
                                       store::duration timeout = store::default_timeout) {
  return file_store::create(context.get_executor(), path, num_workers, timeout);
}

// The whole contract, through co_await.
asio::awaitable<void> contract(std::shared_ptr<file_store> s) {
  auto n = co_await s->num_keys();
  CHECK(n == 0);

  co_await s->set("a", "1");
  auto a = co_await s->get("a");
  CHECK(a == "1");
  co_await s->set("a", "2");
  a = co_await s->get("a");
  CHECK(a == "2");

  // add: a missing key starts from 0; values are decimal text.
  auto v = co_await s->add("n", 5);
  CHECK(v == 5);
  v = co_await s->add("n", -7);
  CHECK(v == -2);
  auto text = co_await s->get("n");
  CHECK(text == "-2");
  co_await s->set("word", "hello");
  auto err = co_await error_of(s->add("word", 1));
  REQUIRE(err);
  CHECK(err->code() == dcomm::errc::invalid_argument);
  CHECK(err->context().key == "word");
  text = co_await s->get("word");
  CHECK(text == "hello");

  // compare_set, as c10d.
  auto r = co_await s->compare_set("c", "x", "y");  // missing, expected given: no set
  CHECK(r == "x");
  std::vector<std::string> only_c(1, "c");
  auto present = co_await s->check(only_c);
  CHECK_FALSE(present);
  r = co_await s->compare_set("c", "", "y");  // missing, expected empty: set
  CHECK(r == "y");
  r = co_await s->compare_set("c", "z", "w");  // mismatch
  CHECK(r == "y");
  r = co_await s->compare_set("c", "y", "w");  // match
  CHECK(r == "w");
  r = co_await s->get("c");
  CHECK(r == "w");
  r = co_await s->compare_set("c", "", "q");  // existing value is not empty
  CHECK(r == "w");

  // wait / check.
  std::vector<std::string> keys{"a", "n", "c"};
  co_await s->wait(keys);
  co_await s->wait(keys, 10ms);
  present = co_await s->check(keys);
  CHECK(present);
  std::vector<std::string> some_missing{"a", "nope"};
  present = co_await s->check(some_missing);
  CHECK_FALSE(present);
  std::vector<std::string> none;
  present = co_await s->check(none);
  CHECK(present);

  n = co_await s->num_keys();
  CHECK(n == 4);  // a, n, word, c

  // delete_key.
  auto existed = co_await s->delete_key("a");
  CHECK(existed);
  existed = co_await s->delete_key("a");
  CHECK_FALSE(existed);
  std::vector<std::string> only_a(1, "a");
  present = co_await s->check(only_a);
  CHECK_FALSE(present);
  n = co_await s->num_keys();
  CHECK(n == 3);
  v = co_await s->add("a", 3);  // a deleted key starts from 0 again
  CHECK(v == 3);
}

asio::awaitable<void> add_many(std::shared_ptr<file_store> s, std::string key, int count) {
  for (int i = 0; i < count; ++i) co_await s->add(key, 1);
}

asio::awaitable<void> add_forever(std::shared_ptr<file_store> s) {
  for (;;) co_await s->add("counter", 1);
}

// A barrier across the processes of a fork_world.
asio::awaitable<void> barrier(std::shared_ptr<file_store> s, std::string name, int rank, int n) {
  co_await s->set(name + "/" + std::to_string(rank), "");
  std::vector<std::string> keys;
  for (int r = 0; r < n; ++r) keys.push_back(name + "/" + std::to_string(r));
  co_await s->wait(keys, 20s);
}

}  // namespace

TEST_CASE("file_store: records are framed so a torn or corrupt one never decodes") {
  DCOMM_TEST_DEADLINE(std::chrono::seconds(10));
  const std::string key("k\0ey", 4);
  const std::string value("v\0\xff\x01", 4);
  const std::string rec = file_log::encode_set(key, value);
  CHECK(rec.size() == file_log::record_overhead + key.size() + value.size());
  file_log::record r;
  REQUIRE(file_log::decode(rec, r) == rec.size());
  CHECK(r.type == file_log::record_type::set);
  CHECK(r.key == key);
  CHECK(r.value == value);
  // Followed by more bytes: decodes this record only.
  CHECK(file_log::decode(rec + "xyz", r) == rec.size());
  // Every proper prefix is torn.
  for (std::size_t n = 0; n < rec.size(); ++n) CHECK(file_log::decode(rec.substr(0, n), r) == 0);
  // Every flipped byte is detected.
  for (std::size_t i = 0; i < rec.size(); ++i) {
    std::string bad = rec;
    bad[i] = static_cast<char>(bad[i] ^ 0x20);
    CHECK(file_log::decode(bad, r) == 0);
  }
  // Zeros (a hole left by a crash) are not a record.
  CHECK(file_log::decode(std::string(64, '\0'), r) == 0);
  const std::string del = file_log::encode_erase(key);
  REQUIRE(file_log::decode(del, r) == del.size());
  CHECK(r.type == file_log::record_type::erase);
  CHECK(r.key == key);
}

TEST_CASE("file_store: the store contract through co_await") {
  DCOMM_TEST_DEADLINE(std::chrono::seconds(20));
  temp_dir dir;
  asio::io_context context;
  auto s = open_store(context, dir.file("store"));
  CHECK(s->address() == "file://" + dir.file("store"));
  dcomm::sync_wait(context, contract(s));
  // A fresh instance replays the same table from the file.
  auto t = open_store(context, dir.file("store"));
  auto a = dcomm::sync_wait(context, t->get("a"));
  CHECK(a == "3");
  auto n = dcomm::sync_wait(context, t->num_keys());
  CHECK(n == 4);
  CHECK(log_is_clean(dir.file("store")));
}

TEST_CASE("file_store: the blocking API on an io_thread") {
  DCOMM_TEST_DEADLINE(std::chrono::seconds(20));
  temp_dir dir;
  dcomm::detail::io_thread io;
  auto s = file_store::create(io.get_executor(), dir.file("store"));
  s->set("k", "v", dcomm::blocking);
  CHECK(s->get("k", dcomm::blocking) == "v");
  CHECK(s->add("n", 2, dcomm::blocking) == 2);
  CHECK(s->add("n", 2, dcomm::blocking) == 4);
  CHECK(s->compare_set("k", "v", "w", dcomm::blocking) == "w");
  CHECK(s->check(std::vector<std::string>{"k", "n"}, dcomm::blocking));
  s->wait(std::vector<std::string>{"k", "n"}, 100ms, dcomm::blocking);
  CHECK(s->num_keys(dcomm::blocking) == 2);
  CHECK(s->delete_key("k", dcomm::blocking));
  CHECK_FALSE(s->check(std::vector<std::string>{"k"}, dcomm::blocking));
  auto future = s->get("n", asio::use_future);
  CHECK(future.get() == "4");
  try {
    s->get("k", 50ms, dcomm::blocking);
    FAIL("get of a deleted key returned");
  } catch (const dcomm::error& e) {
    CHECK(e.code() == dcomm::errc::timeout);
  }
}

TEST_CASE("file_store: keys and values are binary-safe") {
  DCOMM_TEST_DEADLINE(std::chrono::seconds(20));
  temp_dir dir;
  asio::io_context context;
  auto s = open_store(context, dir.file("store"));
  std::string all_bytes;
  for (int i = 0; i < 256; ++i) all_bytes += static_cast<char>(i);
  const std::string key("bin\0key\n", 8);
  const std::string other("bin\0kez", 7);
  dcomm::sync_wait(context, s->set(key, all_bytes));
  dcomm::sync_wait(context, s->set(other, std::string()));
  dcomm::sync_wait(context, s->set("big", std::string(1 << 20, '\0')));
  auto t = open_store(context, dir.file("store"));
  for (auto* st : {s.get(), t.get()}) {
    CHECK(dcomm::sync_wait(context, st->get(key)) == all_bytes);
    CHECK(dcomm::sync_wait(context, st->get(other)).empty());
    CHECK(dcomm::sync_wait(context, st->get("big")) == std::string(1 << 20, '\0'));
    CHECK_FALSE(dcomm::sync_wait(context, st->check(std::vector<std::string>{"bin"})));
  }
  CHECK(dcomm::sync_wait(context, t->compare_set(key, all_bytes, "x")) == "x");
  CHECK(dcomm::sync_wait(context, s->get(key)) == "x");
}

TEST_CASE("file_store: get and wait time out naming the missing keys") {
  DCOMM_TEST_DEADLINE(std::chrono::seconds(20));
  temp_dir dir;
  const std::string path = dir.file("store");
  asio::io_context context;
  auto s = open_store(context, path);
  dcomm::sync_wait(context, s->set("a", "1"));

  auto start = std::chrono::steady_clock::now();
  auto err = sync_error_of(context, s->wait(std::vector<std::string>{"a", "b", "c"}, 200ms));
  auto elapsed = std::chrono::steady_clock::now() - start;
  REQUIRE(err);
  CHECK(err->code() == dcomm::errc::timeout);
  CHECK(err->context().operation == "file_store.wait");
  CHECK(err->context().key == "b, c");
  CHECK(err->context().address == "file://" + path);
  CHECK(elapsed >= 200ms);
  CHECK(elapsed < 1500ms);

  start = std::chrono::steady_clock::now();
  err = sync_error_of(context, s->get("missing", 150ms));
  elapsed = std::chrono::steady_clock::now() - start;
  REQUIRE(err);
  CHECK(err->code() == dcomm::errc::timeout);
  CHECK(err->context().operation == "file_store.get");
  CHECK(err->context().key == "missing");
  CHECK(std::string(err->what()).find(path) != std::string::npos);
  CHECK(elapsed >= 150ms);
  CHECK(elapsed < 1500ms);

  // The store's own timeout is the default deadline.
  s->set_timeout(100ms);
  err = sync_error_of(context, s->get("missing"));
  REQUIRE(err);
  CHECK(err->code() == dcomm::errc::timeout);
}

TEST_CASE("file_store: a key set later wakes a waiting get") {
  DCOMM_TEST_DEADLINE(std::chrono::seconds(20));
  temp_dir dir;
  dcomm::detail::io_thread io_a, io_b;
  auto a = file_store::create(io_a.get_executor(), dir.file("store"));
  auto b = file_store::create(io_b.get_executor(), dir.file("store"));
  auto value = a->get("late", 10s, asio::use_future);
  auto both = a->wait(std::vector<std::string>{"late", "later"}, 10s, asio::use_future);
  std::this_thread::sleep_for(100ms);
  b->set("late", "here", dcomm::blocking);
  CHECK(value.get() == "here");
  std::this_thread::sleep_for(50ms);
  b->set("later", "", dcomm::blocking);
  both.get();
}

TEST_CASE("file_store: reserved keys are refused and not counted") {
  DCOMM_TEST_DEADLINE(std::chrono::seconds(20));
  temp_dir dir;
  asio::io_context context;
  auto s = open_store(context, dir.file("store"), 2);  // registers under the reserved prefix
  CHECK(dcomm::sync_wait(context, s->num_keys()) == 0);
  dcomm::sync_wait(context, s->set("x", "1"));
  CHECK(dcomm::sync_wait(context, s->num_keys()) == 1);
  const std::string reserved = std::string(file_store::reserved_prefix) + "instances";
  auto err = dcomm::sync_wait(context, error_of(s->set(reserved, "0")));
  REQUIRE(err);
  CHECK(err->code() == dcomm::errc::invalid_argument);
  err = dcomm::sync_wait(context, error_of(s->add(reserved, -1)));
  REQUIRE(err);
  CHECK(err->code() == dcomm::errc::invalid_argument);
  err = dcomm::sync_wait(context, error_of(s->check(std::vector<std::string>{"x", reserved})));
  REQUIRE(err);
  CHECK(err->code() == dcomm::errc::invalid_argument);
}

TEST_CASE("file_store: two instances in one process exclude each other") {
  DCOMM_TEST_DEADLINE(std::chrono::seconds(60));
  temp_dir dir;
  const std::string path = dir.file("store");
  constexpr int per_thread = 500;
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t)
    threads.emplace_back([&path] {
      dcomm::detail::io_thread io;
      auto s = file_store::create(io.get_executor(), path);
      for (int i = 0; i < per_thread; ++i) s->add("counter", 1, dcomm::blocking);
    });
  for (auto& t : threads) t.join();
  asio::io_context context;
  auto s = open_store(context, path);
  CHECK(dcomm::sync_wait(context, s->get("counter")) == std::to_string(2 * per_thread));

  // An OFD lock held in this process blocks an instance in this process.
  int fd = lock_raw(path, F_WRLCK);
  REQUIRE(fd >= 0);
  s->set_timeout(100ms);
  auto err = dcomm::sync_wait(context, error_of(s->add("counter", 1)));
  ::close(fd);
  REQUIRE(err);
  CHECK(err->code() == dcomm::errc::timeout);
  s->set_timeout(5s);
  CHECK(dcomm::sync_wait(context, s->add("counter", 1)) == 2 * per_thread + 1);
}

TEST_CASE("file_store: one instance used from several threads at once") {
  DCOMM_TEST_DEADLINE(std::chrono::seconds(60));
  temp_dir dir;
  asio::io_context context;
  auto guard = asio::make_work_guard(context);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back([&context] { context.run(); });
  auto s = file_store::create(context.get_executor(), dir.file("store"));
  std::vector<std::future<void>> done;
  for (int t = 0; t < 4; ++t)
    done.push_back(asio::co_spawn(context, add_many(s, "counter", 200), asio::use_future));
  for (auto& f : done) f.get();
  CHECK(s->get("counter", asio::use_future).get() == "800");
  guard.reset();
  context.stop();
  for (auto& t : threads) t.join();
}

TEST_CASE("file_store: 8 processes x 1000 add on one key end at exactly 8000") {
  DCOMM_TEST_DEADLINE(std::chrono::seconds(120));
  temp_dir dir;
  const std::string path = dir.file("store");
  const auto start = std::chrono::steady_clock::now();
  auto results = dcomm::test::fork_world(8, 100s, [&path](int) {
    asio::io_context context;
    auto s = open_store(context, path);
    dcomm::sync_wait(context, add_many(s, "counter", 1000));
    return 0;
  });
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::steady_clock::now() - start)
                      .count();
  MESSAGE("8 processes x 1000 add took " << ms << " ms");
  for (const auto& r : results) CHECK_MESSAGE(r.ok(), dcomm::test::describe(results));
  asio::io_context context;
  auto s = open_store(context, path);
  CHECK(dcomm::sync_wait(context, s->get("counter")) == "8000");
  CHECK(log_is_clean(path));
}

TEST_CASE("file_store: compare_set race across processes has exactly one winner") {
  DCOMM_TEST_DEADLINE(std::chrono::seconds(60));
  temp_dir dir;
  const std::string path = dir.file("store");
  constexpr int rounds = 20;
  auto results = dcomm::test::fork_world(8, 40s, [&path](int rank) {
    asio::io_context context;
    auto s = open_store(context, path);
    dcomm::sync_wait(context, barrier(s, "start", rank, 8));
    for (int round = 0; round < rounds; ++round) {
      const std::string key = "owner/" + std::to_string(round);
      const std::string me = std::to_string(rank);
      if (dcomm::sync_wait(context, s->compare_set(key, "", me)) == me)
        dcomm::sync_wait(context, s->add("wins/" + std::to_string(round), 1));
    }
    return 0;
  });
  for (const auto& r : results) CHECK_MESSAGE(r.ok(), dcomm::test::describe(results));
  asio::io_context context;
  auto s = open_store(context, path);
  for (int round = 0; round < rounds; ++round) {
    CHECK(dcomm::sync_wait(context, s->get("wins/" + std::to_string(round))) == "1");
    const auto owner = dcomm::sync_wait(context, s->get("owner/" + std::to_string(round)));
    CHECK(owner.size() == 1);
    CHECK(owner >= "0");
    CHECK(owner <= "7");
  }
}

TEST_CASE("file_store: a torn record at the end is ignored, then cut off") {
  DCOMM_TEST_DEADLINE(std::chrono::seconds(30));
  temp_dir dir;
  const std::string path = dir.file("store");
  asio::io_context context;
  auto writer = open_store(context, path);
  dcomm::sync_wait(context, writer->set("a", "1"));
  const std::string full = file_log::encode_set("b", "2");
  std::string corrupt = full;
  corrupt[file_log::record_prefix + 1] = '3';  // the value, under an unchanged checksum
  const std::vector<std::string> tails{full.substr(0, 1), full.substr(0, 7),
                                       full.substr(0, file_log::record_prefix + 1),
                                       full.substr(0, full.size() - 1), corrupt};
  for (const auto& tail : tails) {
    CAPTURE(tail.size());
    const auto clean_size = read_whole(path).size();
    // A crashed writer: took the lock, appended part of a record, died.
    auto results = dcomm::test::fork_world(1, 10s, [&](int) {
      int fd = lock_raw(path, F_WRLCK);
      if (fd < 0) return 2;
      append_raw(fd, tail);
      return 0;  // exits holding the lock; the kernel releases it
    });
    REQUIRE(results[0].ok());
    CHECK(read_whole(path).size() == clean_size + tail.size());
    CHECK_FALSE(log_is_clean(path));

    // Readers, old and new, ignore the tail.
    auto reader = open_store(context, path);
    for (auto* s : {writer.get(), reader.get()}) {
      CHECK(dcomm::sync_wait(context, s->get("a")) == "1");
      CHECK_FALSE(dcomm::sync_wait(context, s->check(std::vector<std::string>{"b"})));
      CHECK(dcomm::sync_wait(context, s->num_keys()) == 1);
    }
    auto err = dcomm::sync_wait(context, error_of(reader->get("b", 20ms)));
    REQUIRE(err);
    CHECK(err->code() == dcomm::errc::timeout);
    CHECK(read_whole(path).size() == clean_size + tail.size());  // readers do not write

    // The next writer cuts it off before appending.
    dcomm::sync_wait(context, reader->set("c", "3"));
    CHECK(log_is_clean(path));
    CHECK(read_whole(path).size() == clean_size + file_log::encode_set("c", "3").size());
    for (auto* s : {writer.get(), reader.get()}) {
      CHECK(dcomm::sync_wait(context, s->get("c")) == "3");
      CHECK_FALSE(dcomm::sync_wait(context, s->check(std::vector<std::string>{"b"})));
    }
    CHECK(dcomm::sync_wait(context, writer->delete_key("c")));
  }
}

TEST_CASE("file_store: a header left incomplete by a crashed creator") {
  DCOMM_TEST_DEADLINE(std::chrono::seconds(20));
  temp_dir dir;
  const std::string path = dir.file("store");
  for (std::size_t n : {std::size_t{0}, std::size_t{3}, std::size_t{8}, std::size_t{12}}) {
    CAPTURE(n);
    std::ofstream(path, std::ios::binary | std::ios::trunc)
        << file_log::encode_header(42).substr(0, n);
    asio::io_context context;
    auto s = open_store(context, path);
    CHECK(dcomm::sync_wait(context, s->num_keys()) == 0);
    auto err = dcomm::sync_wait(context, error_of(s->get("a", 10ms)));
    REQUIRE(err);
    CHECK(err->code() == dcomm::errc::timeout);
    CHECK(read_whole(path).size() == n);  // readers do not write
    dcomm::sync_wait(context, s->set("a", "1"));
    CHECK(log_is_clean(path));
    CHECK(dcomm::sync_wait(context, s->get("a")) == "1");
    REQUIRE(::unlink(path.c_str()) == 0);
  }
}

TEST_CASE("file_store: a writer killed while holding the lock; the others carry on") {
  DCOMM_TEST_DEADLINE(std::chrono::seconds(60));
  temp_dir dir;
  const std::string path = dir.file("store");
  const std::string pid_file = dir.file("victim.pid");
  auto results = dcomm::test::fork_world(2, 30s, [&](int rank) {
    asio::io_context context;
    auto s = open_store(context, path, -1, 10s);
    if (rank == 0) {  // the victim
      dcomm::sync_wait(context, s->set("before", "yes"));
      dcomm::sync_wait(context, add_many(s, "counter", 10));
      int fd = lock_raw(path, F_WRLCK);
      if (fd < 0) return 2;
      const std::string rec = file_log::encode_set("counter", "999999");
      append_raw(fd, rec.substr(0, rec.size() / 2));
      write_pid(pid_file);
      for (;;) ::pause();  // killed here, holding the lock, mid-record
    }
    const pid_t victim = wait_for_pid(pid_file, 20s);
    // While the victim lives, its lock keeps writers out.
    s->set_timeout(100ms);
    auto err = sync_error_of(context, s->add("counter", 1));
    if (!err || err->code() != dcomm::errc::timeout) return 3;
    ::kill(victim, SIGKILL);
    s->set_timeout(10s);
    if (dcomm::sync_wait(context, s->add("counter", 1)) != 11) return 4;
    if (dcomm::sync_wait(context, s->get("before")) != "yes") return 5;
    return 0;
  });
  CHECK_MESSAGE(results[0].signal == SIGKILL, dcomm::test::describe(results));
  CHECK_MESSAGE(results[1].ok(), dcomm::test::describe(results));
  CHECK(log_is_clean(path));

  // Everyone else carries on with the right counts.
  results = dcomm::test::fork_world(4, 30s, [&path](int) {
    asio::io_context context;
    auto s = open_store(context, path);
    dcomm::sync_wait(context, add_many(s, "counter", 100));
    return 0;
  });
  for (const auto& r : results) CHECK_MESSAGE(r.ok(), dcomm::test::describe(results));
  asio::io_context context;
  auto s = open_store(context, path);
  CHECK(dcomm::sync_wait(context, s->get("counter")) == "411");
  CHECK(log_is_clean(path));
}

TEST_CASE("file_store: writers killed at arbitrary points leave a readable store") {
  DCOMM_TEST_DEADLINE(std::chrono::seconds(60));
  temp_dir dir;
  const std::string path = dir.file("store");
  asio::io_context context;
  auto s = open_store(context, path, -1, 10s);
  std::int64_t last = 0;
  int torn = 0;
  for (int round = 0; round < 5; ++round) {
    // fork_world SIGKILLs them at its deadline, wherever they are.
    auto limit = std::chrono::milliseconds(200 + 37 * round);
    auto results = dcomm::test::fork_world(3, limit, [&path](int) {
      asio::io_context context;
      auto child = open_store(context, path, -1, 10s);
      dcomm::sync_wait(context, add_forever(child));
      return 0;
    });
    for (const auto& r : results) CHECK_MESSAGE(r.timed_out, dcomm::test::describe(results));
    torn += log_is_clean(path) ? 0 : 1;
    const auto before = std::stoll(dcomm::sync_wait(context, s->get("counter")));
    CHECK(before >= last);  // normally more: the writers made progress
    last = dcomm::sync_wait(context, s->add("counter", 1));
    CHECK(last == before + 1);
    CHECK(log_is_clean(path));
  }
  CHECK(last > 5);
  MESSAGE("counter after the killed writers: " << last << "; rounds that left a torn tail: " << torn
                                               << " of 5");
}

TEST_CASE("file_store: a lock held by a stopped process times out within the deadline") {
  DCOMM_TEST_DEADLINE(std::chrono::seconds(60));
  temp_dir dir;
  const std::string path = dir.file("store");
  {
    asio::io_context context;
    auto s = open_store(context, path);
    dcomm::sync_wait(context, s->set("k", "v"));
  }
  for (short type : {short(F_WRLCK), short(F_RDLCK)}) {
    CAPTURE(type);
    const std::string pid_file = dir.file("stopped.pid." + std::to_string(type));
    auto results = dcomm::test::fork_world(2, 30s, [&](int rank) {
      if (rank == 0) {
        int fd = lock_raw(path, type);
        if (fd < 0) return 2;
        write_pid(pid_file);
        ::raise(SIGSTOP);  // stopped, holding the lock
        return 0;          // continued: exits, releasing it
      }
      const pid_t holder = wait_for_pid(pid_file, 20s);
      asio::io_context context;
      auto s = open_store(context, path, -1, 300ms);
      int code = 0;
      auto start = std::chrono::steady_clock::now();
      auto err = sync_error_of(context, s->set("k", "w"));
      auto elapsed = std::chrono::steady_clock::now() - start;
      if (!err || err->code() != dcomm::errc::timeout) code = 3;
      if (err && (std::string(err->what()).find(path) == std::string::npos ||
                  std::string(err->what()).find("lock") == std::string::npos))
        code = 4;
      if (elapsed < 300ms || elapsed > 2s) code = 5;
      if (err) std::fprintf(stderr, "(expected) %s\n", err->what());
      if (type == F_WRLCK) {
        // Readers wait for a writer too.
        start = std::chrono::steady_clock::now();
        err = sync_error_of(context, s->get("k", 200ms));
        elapsed = std::chrono::steady_clock::now() - start;
        if (!err || err->code() != dcomm::errc::timeout) code = 6;
        if (elapsed < 200ms || elapsed > 2s) code = 7;
      } else {
        // A shared lock lets readers in.
        if (dcomm::sync_wait(context, s->get("k")) != "v") code = 8;
      }
      ::kill(holder, SIGCONT);
      s->set_timeout(10s);
      dcomm::sync_wait(context, s->set("k", "v"));
      return code;
    });
    for (const auto& r : results) CHECK_MESSAGE(r.ok(), dcomm::test::describe(results));
  }
}

TEST_CASE("file_store: the file is removed when num_workers instances are gone") {
  DCOMM_TEST_DEADLINE(std::chrono::seconds(60));
  temp_dir dir;
  asio::io_context context;
  SUBCASE("in one process") {
    const std::string path = dir.file("three");
    auto a = open_store(context, path, 3);
    auto b = open_store(context, path, 3);
    auto c = open_store(context, path, 3);
    dcomm::sync_wait(context, a->set("x", "1"));
    a.reset();
    b.reset();
    CHECK(exists(path));
    CHECK(dcomm::sync_wait(context, c->get("x")) == "1");
    c.reset();
    CHECK_FALSE(exists(path));
  }
  SUBCASE("not while more instances than num_workers are alive") {
    const std::string path = dir.file("two");
    auto a = open_store(context, path, 2);
    auto b = open_store(context, path, 2);
    auto c = open_store(context, path, 2);
    a.reset();
    b.reset();
    CHECK(exists(path));
    c.reset();
    CHECK_FALSE(exists(path));
  }
  SUBCASE("never with num_workers = -1") {
    const std::string path = dir.file("kept");
    auto a = open_store(context, path);
    auto b = open_store(context, path);
    dcomm::sync_wait(context, a->set("x", "1"));
    a.reset();
    b.reset();
    CHECK(exists(path));
  }
  SUBCASE("across processes") {
    const std::string path = dir.file("procs");
    auto results = dcomm::test::fork_world(4, 30s, [&path](int rank) {
      asio::io_context context;
      auto s = open_store(context, path, 4);
      dcomm::sync_wait(context, s->add("work", 1));
      dcomm::sync_wait(context, barrier(s, "done", rank, 4));
      return 0;  // s is destroyed here
    });
    for (const auto& r : results) CHECK_MESSAGE(r.ok(), dcomm::test::describe(results));
    CHECK_FALSE(exists(path));
  }
}

TEST_CASE("file_store: a file removed and created again is read afresh") {
  DCOMM_TEST_DEADLINE(std::chrono::seconds(20));
  temp_dir dir;
  const std::string path = dir.file("store");
  asio::io_context context;
  auto old_instance = open_store(context, path);
  dcomm::sync_wait(context, old_instance->set("old", "1"));
  CHECK(dcomm::sync_wait(context, old_instance->num_keys()) == 1);
  REQUIRE(::unlink(path.c_str()) == 0);
  auto fresh = open_store(context, path);
  dcomm::sync_wait(context, fresh->set("new", "2"));
  CHECK_FALSE(dcomm::sync_wait(context, old_instance->check(std::vector<std::string>{"old"})));
  CHECK(dcomm::sync_wait(context, old_instance->get("new")) == "2");
  CHECK(dcomm::sync_wait(context, old_instance->num_keys()) == 1);
}

TEST_CASE("file_store: bad paths are refused, naming the path and the reason") {
  DCOMM_TEST_DEADLINE(std::chrono::seconds(20));
  temp_dir dir;
  auto refused = [](const std::string& path) -> std::optional<dcomm::error> {
    try {
      asio::io_context context;
      file_store::create(context.get_executor(), path);
    } catch (const dcomm::error& e) {
      return e;
    }
    return std::nullopt;
  };
  const std::string missing_dir = dir.file("no/such/dir/store");
  auto err = refused(missing_dir);
  REQUIRE(err);
  CHECK(err->code() == dcomm::errc::invalid_argument);
  CHECK(std::string(err->what()).find(missing_dir) != std::string::npos);
  CHECK(std::string(err->what()).find("No such file or directory") != std::string::npos);

  err = refused(dir.path);  // a directory
  REQUIRE(err);
  CHECK(err->code() == dcomm::errc::invalid_argument);
  CHECK(std::string(err->what()).find(dir.path) != std::string::npos);

  err = refused("");
  REQUIRE(err);
  CHECK(err->code() == dcomm::errc::invalid_argument);

  // Some other file: refused, and left as it was.
  const std::string foreign = dir.file("notes.txt");
  std::ofstream(foreign) << "hello, world\n";
  err = refused(foreign);
  REQUIRE(err);
  CHECK(err->code() == dcomm::errc::invalid_argument);
  CHECK(std::string(err->what()).find("not a dcomm file_store file") != std::string::npos);
  CHECK(read_whole(foreign) == "hello, world\n");
}
