// The MPI backend under the real mpirun (tests/meson.build runs this
// program with -np 1, 3 and 4): every rank runs every case in the same
// order, each operation bounded by a deadline, results compared with
// expectations computed here (counts not divisible by the world, 0
// elements, every dtype, in place and out of place).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <dcomm/dcomm.hpp>
#include <dcomm/mpi.hpp>
#include <numeric>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "mpi/mpi_world.hpp"

using namespace std::chrono_literals;

namespace {

dcomm::communicator<dcomm::mpi_backend>& comm() {
  return dcomm::test::mpi_world();
}

// Values every rank can compute for rank r's element i (small integers:
// exact in every dtype, fp16 and bf16 included).
double value(int r, std::size_t i) {
  return static_cast<double>((r + 1) * 2 + static_cast<int>(i % 5));
}

template <class T>
std::vector<T> filled(int r, std::size_t n) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<T>(value(r, i));
  return v;
}

template <class T>
void all_reduce_every_op() {
  constexpr bool floating = !std::is_integral_v<T>;
  auto& c = comm();
  const int n = c.size(), me = c.rank();
  for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000}}) {
    auto sum = filled<T>(me, count);
    c.all_reduce(sum, dcomm::sum, dcomm::blocking);
    auto mx = filled<T>(me, count);
    c.all_reduce(mx, dcomm::max, dcomm::blocking);
    auto avg = filled<T>(me, count);
    if constexpr (floating) c.all_reduce(avg, dcomm::avg, dcomm::blocking);
    for (std::size_t i = 0; i < count; ++i) {
      double s = 0;
      for (int r = 0; r < n; ++r) s += value(r, i);
      CHECK(static_cast<double>(sum[i]) == doctest::Approx(s));
      CHECK(static_cast<double>(mx[i]) == doctest::Approx(value(n - 1, i)));
      if constexpr (floating)
        CHECK(static_cast<double>(avg[i]) == doctest::Approx(s / n).epsilon(0.01));
    }
  }
}

}  // namespace

TEST_CASE("the world comes from MPI") {
  auto& c = comm();  // dcomm initialises MPI
  int rank = -1, size = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  CHECK(c.rank() == rank);
  CHECK(c.size() == size);
  // The launcher's world size, where it says one, is MPI's: a launch
  // whose ranks could not reach each other (srun without the MPI
  // library's PMI plugin: MPICH then starts each rank as a singleton)
  // must not pass once per rank (init refuses a world of 1: next case).
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"}) {
    if (const char* v = std::getenv(name); v && *v) {
      const std::string said = std::string(name) + " = " + v;
      INFO(said);
      CHECK(std::atoi(v) == size);
      break;
    }
  }
  int level = 0;
  MPI_Query_thread(&level);
  CHECK(level >= MPI_THREAD_SERIALIZED);
  // The blocking init_process_group initialised MPI on this thread, not on
  // its io thread: this thread calls MPI_Finalize at exit, as MPI asks.
  int main_thread = 0;
  MPI_Is_thread_main(&main_thread);
  CHECK(main_thread != 0);
}

// A launch whose ranks MPI cannot join (srun without the MPI library's
// PMI plugin) starts each as a singleton: refused at init, naming the
// launcher's count, rather than each rank training alone. Shown in the
// world of 1 by saying the launcher started 3; a program that wants
// singletons says so with MPI_COMM_SELF.
TEST_CASE("a launcher's world that MPI does not see is refused") {
  auto& c = comm();
  if (c.size() != 1) return;  // the check is for a world of 1
  const char* was = std::getenv("OMPI_COMM_WORLD_SIZE");
  const std::string saved = was ? was : "";
  ::setenv("OMPI_COMM_WORLD_SIZE", "3", 1);
  std::string refusal;
  try {
    dcomm::init_process_group<dcomm::mpi_backend>({.timeout = 30s});
  } catch (const dcomm::error& e) {
    CHECK(e.code() == dcomm::errc::mismatch);
    refusal = e.what();
  }
  CHECK(refusal.find("OMPI_COMM_WORLD_SIZE=3") != std::string::npos);
  CHECK(refusal.find("--mpi=pmi2") != std::string::npos);
  auto alone = dcomm::init_process_group<dcomm::mpi_backend>(
      {.timeout = 30s, .backend = {.comm = MPI_COMM_SELF}});
  CHECK(alone.size() == 1);
  if (was)
    ::setenv("OMPI_COMM_WORLD_SIZE", saved.c_str(), 1);
  else
    ::unsetenv("OMPI_COMM_WORLD_SIZE");
}

TEST_CASE("all_reduce: every dtype, sum, max and avg") {
  all_reduce_every_op<float>();
  all_reduce_every_op<double>();
  all_reduce_every_op<std::int8_t>();
  all_reduce_every_op<std::uint8_t>();
  all_reduce_every_op<std::int32_t>();
  all_reduce_every_op<std::int64_t>();
  all_reduce_every_op<dcomm::float16>();
  all_reduce_every_op<dcomm::bfloat16>();
}

TEST_CASE("all_reduce: a custom functor, premul_sum, out of place") {
  auto& c = comm();
  const int n = c.size(), me = c.rank();
  std::vector<std::int64_t> in(5, me + 1), out(5, -1);
  auto larger_abs = [](std::int64_t a, std::int64_t b) { return a > b ? a : b; };
  c.all_reduce(in, out, larger_abs, dcomm::blocking);
  CHECK(out == std::vector<std::int64_t>(5, n));
  CHECK(in == std::vector<std::int64_t>(5, me + 1));  // the input is not modified
  std::vector<float> x(3, 1.0f);
  c.all_reduce(x, dcomm::premul_sum(0.5), dcomm::blocking);
  CHECK(x[0] == doctest::Approx(0.5 * n));
}

// Up to options::p2p_all_reduce_limit (16 KiB) an all_reduce is dcomm's
// recursive doubling over messages; above it, a ring of messages where
// each rank's block is 8 KiB or more (options::ring_all_reduce_block),
// else MPI_Iallreduce (in worlds 3 and 4, limit + 1 elements). Each
// gives every rank the same bits, here with float sums whose value
// depends on the order of the additions, and the exact sum where it
// does not (a count that 3 and 4 do not divide, for the ring).
TEST_CASE("all_reduce by doubling, MPI's and the ring: the same bits everywhere") {
  auto& c = comm();
  const int n = c.size(), me = c.rank();
  const std::size_t limit = dcomm::mpi_backend::options{}.p2p_all_reduce_limit / sizeof(float);
  for (std::size_t count : {limit - 1, limit, limit + 1, std::size_t{100'003}}) {
    CAPTURE(count);
    std::vector<float> x(count);
    for (std::size_t i = 0; i < count; ++i)  // 1e8 + small: rounding depends on order
      x[i] =
          (me % 2 ? 1e8f : 1.0f) + static_cast<float>((i * 7 + static_cast<std::size_t>(me)) % 13);
    c.all_reduce(x, dcomm::sum, dcomm::blocking);
    std::vector<float> everyone(count * static_cast<std::size_t>(n));
    c.all_gather(x, everyone, dcomm::blocking);
    int differ = 0;
    for (int r = 0; r < n; ++r)
      differ += std::memcmp(everyone.data() + static_cast<std::size_t>(r) * count, x.data(),
                            count * sizeof(float)) != 0;
    CHECK(differ == 0);
    std::vector<std::int64_t> k(count);
    for (std::size_t i = 0; i < count; ++i) k[i] = static_cast<std::int64_t>(i) * (me + 1);
    c.all_reduce(k, dcomm::sum, dcomm::blocking);
    const std::int64_t ranks = n * (n + 1) / 2;
    CHECK(k[count - 1] == static_cast<std::int64_t>(count - 1) * ranks);
    CHECK(k[count / 2] == static_cast<std::int64_t>(count / 2) * ranks);
  }
}

// Calls that differ in size on the message path (a barrier is an
// all_reduce of nothing there): every rank fails with errc::mismatch (not
// only the partners of the odd one, and none waits for a step that will
// not come), and the backend goes on.
TEST_CASE("small all_reduces that differ in size: every rank fails with mismatch") {
  auto& c = comm();
  const int n = c.size(), me = c.rank();
  if (n < 2) return;
  std::vector<float> x(me == n - 1 ? 3 : 2, 1.0f);
  std::string failure;
  try {
    c.all_reduce(x, dcomm::sum, dcomm::op_options{.timeout = 10s}, dcomm::blocking);
  } catch (const dcomm::error& e) {
    CHECK(e.code() == dcomm::errc::mismatch);
    failure = e.what();
  }
  INFO(failure);
  CHECK(failure.find("differ in size") != std::string::npos);
  std::vector<int> one{1};
  c.all_reduce(one, dcomm::sum, dcomm::blocking);
  CHECK(one[0] == n);
  // A barrier (the same path, with nothing) against an all_reduce.
  failure.clear();
  try {
    if (me == 0)
      c.barrier(dcomm::op_options{.timeout = 10s}, dcomm::blocking);
    else
      c.all_reduce(x, dcomm::sum, dcomm::op_options{.timeout = 10s}, dcomm::blocking);
  } catch (const dcomm::error& e) {
    CHECK(e.code() == dcomm::errc::mismatch);
    failure = e.what();
  }
  INFO(failure);
  CHECK(failure.find(me == 0 ? "barrier" : "all_reduce") != std::string::npos);
  CHECK(failure.find("differ in size") != std::string::npos);
  c.barrier(dcomm::blocking);
}

TEST_CASE("p2p_all_reduce_limit above 1 MiB is refused before anything is made") {
  std::string refusal;
  try {
    dcomm::init_process_group<dcomm::mpi_backend>(
        {.timeout = 30s, .backend = {.p2p_all_reduce_limit = (1 << 20) + 1}});
  } catch (const dcomm::error& e) {
    CHECK(e.code() == dcomm::errc::invalid_argument);
    refusal = e.what();
  }
  CHECK(refusal.find("p2p_all_reduce_limit") != std::string::npos);
}

TEST_CASE("send and recv: tags, sizes, a mismatch") {
  auto& c = comm();
  const int n = c.size(), me = c.rank();
  if (n < 2) return;
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  std::vector<float> out(10), in(10);
  std::iota(out.begin(), out.end(), static_cast<float>(me * 100));
  auto r = c.recv(in, prev, 7, dcomm::as_request);
  c.send(out, next, 7, dcomm::blocking);
  r.wait();
  CHECK(in[3] == static_cast<float>(prev * 100 + 3));
  // A receive larger than the message: mismatch, naming the sender.
  std::vector<float> small(4, 1.0f), large(6);
  auto big = c.recv(large, prev, 8, dcomm::as_request);
  c.send(small, next, 8, dcomm::blocking);
  try {
    big.wait();
    FAIL("the size mismatch went unnoticed");
  } catch (const dcomm::error& e) {
    CHECK(e.code() == dcomm::errc::mismatch);
    CHECK(std::string(e.what()).find("rank " + std::to_string(prev)) != std::string::npos);
  }
}

TEST_CASE("a receive nobody sends times out, cancelled, and the backend goes on") {
  auto& c = comm();
  if (c.size() < 2) return;  // a receive from oneself is refused
  std::vector<int> x(3);
  try {
    c.recv(x, (c.rank() + 1) % c.size(), 99, dcomm::op_options{.timeout = 200ms}, dcomm::blocking);
    FAIL("no timeout");
  } catch (const dcomm::error& e) {
    CHECK(e.code() == dcomm::errc::timeout);
    CHECK(std::string(e.what()).find("recv") != std::string::npos);
  }
  std::vector<int> one{1};
  c.all_reduce(one, dcomm::sum, dcomm::blocking);
  CHECK(one[0] == c.size());
}

TEST_CASE("broadcast, reduce, scatter, gather from every root") {
  auto& c = comm();
  const int n = c.size(), me = c.rank();
  const std::size_t k = 5;
  for (int root = 0; root < n; ++root) {
    auto b = me == root ? filled<double>(root, k) : std::vector<double>(k, -1);
    c.broadcast(b, root, dcomm::blocking);
    CHECK(b == filled<double>(root, k));

    auto in = filled<std::int32_t>(me, k);
    std::vector<std::int32_t> out(k, -1);
    c.reduce(in, out, root, dcomm::sum, dcomm::blocking);
    if (me == root)
      for (std::size_t i = 0; i < k; ++i) {
        double s = 0;
        for (int r = 0; r < n; ++r) s += value(r, i);
        CHECK(out[i] == static_cast<std::int32_t>(s));
      }

    std::vector<float> all(k * static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < k; ++i)
        all[static_cast<std::size_t>(r) * k + i] = static_cast<float>(value(r, i));
    std::vector<float> mine(k, -1);
    c.scatter(me == root ? all : std::vector<float>{}, mine, root, dcomm::blocking);
    CHECK(mine == filled<float>(me, k));

    std::vector<float> gathered(me == root ? all.size() : 0);
    c.gather(filled<float>(me, k), gathered, root, dcomm::blocking);
    if (me == root) CHECK(gathered == all);
  }
}

TEST_CASE("all_gather, reduce_scatter, all_to_all and the _v forms") {
  auto& c = comm();
  const int n = c.size(), me = c.rank();
  const auto un = static_cast<std::size_t>(n);
  const std::size_t k = 3;
  std::vector<std::int64_t> everyone(k * un);
  c.all_gather(filled<std::int64_t>(me, k), everyone, dcomm::blocking);
  for (int r = 0; r < n; ++r)
    CHECK(std::vector<std::int64_t>(everyone.begin() + r * 3, everyone.begin() + r * 3 + 3) ==
          filled<std::int64_t>(r, k));

  std::vector<float> blocks(k * un, static_cast<float>(me + 1)), part(k);
  c.reduce_scatter(blocks, part, dcomm::sum, dcomm::blocking);
  CHECK(part == std::vector<float>(k, static_cast<float>(n * (n + 1) / 2)));

  std::vector<int> to(un * 2), from(un * 2);
  for (int r = 0; r < n; ++r) to[static_cast<std::size_t>(r) * 2] = to[r * 2 + 1] = me * 10 + r;
  c.all_to_all(to, from, dcomm::blocking);
  for (int r = 0; r < n; ++r) CHECK(from[static_cast<std::size_t>(r) * 2] == r * 10 + me);

  // Rank r contributes r + 1 elements (a world not dividing anything).
  std::vector<float> mine(static_cast<std::size_t>(me + 1), static_cast<float>(me));
  std::vector<float> gathered;
  const auto counts = c.all_gather_v(mine, gathered, dcomm::blocking);
  CHECK(counts.size() == un);
  CHECK(gathered.size() == un * (un + 1) / 2);
  if (!gathered.empty()) CHECK(gathered.back() == static_cast<float>(n - 1));
}

TEST_CASE("groups: split by parity, new_group of rank 0 alone") {
  auto& c = comm();
  const int me = c.rank();
  auto half = c.split(me % 2, me, dcomm::blocking);
  REQUIRE(half.has_value());
  std::vector<int> one{1};
  half->all_reduce(one, dcomm::sum, dcomm::blocking);
  CHECK(one[0] == half->size());
  int mpi_rank = -1;
  MPI_Comm_rank(half->backend().native_handle(), &mpi_rank);  // the world's, not the group's
  CHECK(mpi_rank == me);
  auto alone = c.new_group({0});
  CHECK(alone.has_value() == (me == 0));
  if (alone) {
    std::vector<int> x{5};
    alone->all_reduce(x, dcomm::sum, dcomm::blocking);
    CHECK(x[0] == 5);
  }
  c.barrier(dcomm::blocking);
}

TEST_CASE("a CUDA tensor and an algorithm are refused before anything is sent") {
  auto& c = comm();
  CHECK_THROWS_AS(
      c.barrier(dcomm::op_options{.algorithm = dcomm::algorithm::ring}, dcomm::blocking),
      dcomm::error);
  c.barrier(dcomm::blocking);
}

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  const int result = context.run();
  // Every rank passes here before the communicator closes at exit.
  comm().barrier(dcomm::blocking);
  return result;
}
