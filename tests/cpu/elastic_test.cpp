// Recovering in place (issue 43, docs/elastic.md) on the CPU backend: a
// revocation reaches every member, fails what is pending and what comes
// later, of the group and of the groups made from it, and nothing else;
// revoke_on_failure turns one lost rank into a revocation that reaches the
// ranks that never talk to it. Agreement: the protocol against random
// deaths and message orders (no sockets), then among threads
// (elastic_process_test.cpp: among processes, one killed).
#include <doctest/doctest.h>

#include <chrono>
#include <deque>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dcomm/cpu/transport/agreements.hpp"
#include "support/comm_world.hpp"
#include "support/deadline.hpp"

using namespace std::chrono_literals;
using dcomm::test::comm;
using dcomm::test::contains;
using dcomm::test::failure_of;
using dcomm::test::require;

namespace {

dcomm::op_options patient() {
  return {.timeout = 20s};  // far beyond what a revocation takes to arrive
}

asio::awaitable<void> sleep_for(std::chrono::milliseconds d) {
  asio::steady_timer t(co_await asio::this_coro::executor, d);
  co_await t.async_wait(asio::use_awaitable);
}

// Requires `code, what` to be a revocation by `revoker` for `why`, which
// came well before the 20 s deadline.
void require_revoked(const std::pair<dcomm::errc, std::string>& failure, int revoker,
                     const std::string& why, std::chrono::steady_clock::time_point since,
                     const std::string& call) {
  const auto& [code, what] = failure;
  require(code == dcomm::errc::revoked && contains(what, "peers rank " + std::to_string(revoker)) &&
              contains(what, why),
          call + ": " + (what.empty() ? std::string("succeeded") : what));
  require(std::chrono::steady_clock::now() - since < 10s, call + " waited for its deadline");
}

// The agreement protocol (cpu/transport/agreements.hpp) among n records,
// with messages delivered in a random order (first in first out per
// link, as the transport's links are) and random members killed at random
// moments: a dead member's frames not yet delivered may be lost, and each
// other member learns of the death after what did arrive. Returns what
// went wrong ("" if nothing): every survivor decides; every decision,
// those of members that died after deciding included, is the same; its
// failed set names only dead members; it counts every survivor's flag.
std::string simulate_agreement(int n, std::mt19937& random) {
  using dcomm::cpu::agree_message;
  struct event {
    bool loss = false;
    agree_message m{};
  };
  std::vector<dcomm::cpu::agreement_record> records(static_cast<std::size_t>(n));
  std::vector<std::vector<std::deque<event>>> links(
      static_cast<std::size_t>(n), std::vector<std::deque<event>>(static_cast<std::size_t>(n)));
  std::vector<std::vector<bool>> knows_failed(static_cast<std::size_t>(n),
                                              std::vector<bool>(static_cast<std::size_t>(n)));
  std::vector<bool> alive(static_cast<std::size_t>(n), true), flags(static_cast<std::size_t>(n));
  std::vector<std::optional<dcomm::cpu::agreed_value>> decided(static_cast<std::size_t>(n));
  auto at = [](auto& v, int i) -> decltype(auto) { return v[static_cast<std::size_t>(i)]; };
  auto run_step = [&](int r) {
    auto out = at(records, r).step([&](int i) { return at(at(knows_failed, r), i); });
    for (auto& o : out) at(at(links, r), o.to).push_back({false, std::move(o.m)});
    if (at(records, r).decided() && !at(decided, r)) at(decided, r) = at(records, r).decided();
  };
  for (int r = 0; r < n; ++r) {
    at(flags, r) = random() % 4 != 0;
    at(records, r).enter(r, n, at(flags, r));
  }
  // Up to n - 1 deaths, each at a random event count.
  std::vector<int> death_at(static_cast<std::size_t>(n), -1);
  for (int r = 0, deaths = 0; r < n; ++r)
    if (deaths < n - 1 && random() % 3 == 0) at(death_at, r) = static_cast<int>(random() % 40), ++deaths;
  auto kill = [&](int r) {
    at(alive, r) = false;
    for (int j = 0; j < n; ++j) {
      auto& q = at(at(links, r), j);
      q.resize(q.empty() ? 0 : random() % (q.size() + 1));  // what was never delivered
      q.push_back({true, {}});
    }
  };
  for (int r = 0; r < n; ++r)
    if (at(death_at, r) == 0) kill(r);
  for (int r = 0; r < n; ++r)
    if (at(alive, r)) run_step(r);
  for (int events = 1; events < 100000; ++events) {
    for (int r = 0; r < n; ++r)
      if (at(alive, r) && at(death_at, r) == events) kill(r);
    std::vector<std::pair<int, int>> ready;
    for (int f = 0; f < n; ++f)
      for (int t = 0; t < n; ++t)
        if (at(alive, t) && !at(at(links, f), t).empty()) ready.emplace_back(f, t);
    if (ready.empty()) break;
    auto [f, t] = ready[random() % ready.size()];
    event e = std::move(at(at(links, f), t).front());
    at(at(links, f), t).pop_front();
    if (e.loss)
      at(at(knows_failed, t), f) = true;
    else
      at(records, t).take(f, std::move(e.m));
    run_step(t);
  }
  std::string report;
  std::optional<dcomm::cpu::agreed_value> first;
  bool survivors_flag = true;
  for (int r = 0; r < n; ++r) {
    if (at(alive, r)) survivors_flag = survivors_flag && at(flags, r);
    if (at(alive, r) && !at(decided, r)) report += "survivor " + std::to_string(r) + " undecided; ";
    if (!at(decided, r)) continue;
    if (!first) first = at(decided, r);
    if (!(*at(decided, r) == *first)) report += "rank " + std::to_string(r) + " decided otherwise; ";
  }
  if (first) {
    for (int f : first->failed)
      if (at(alive, f)) report += "a survivor, " + std::to_string(f) + ", decided failed; ";
    if (!survivors_flag && first->flag) report += "a survivor's false flag was not counted; ";
  }
  return report;
}

}  // namespace

TEST_SUITE("cpu elastic") {
  TEST_CASE("the agreement protocol: one decision whoever dies, whatever the order (no sockets)") {
    DCOMM_TEST_DEADLINE(60s);
    std::mt19937 random(20261202);
    for (int trial = 0; trial < 3000; ++trial) {
      const int n = 1 + trial % 7;
      const std::string report = simulate_agreement(n, random);
      INFO("trial " << trial << ", " << n << " members: " << report);
      REQUIRE(report.empty());
    }
  }

  TEST_CASE("agree: every member gets the AND of the flags, in worlds 1 to 5, also revoked") {
    DCOMM_TEST_DEADLINE(60s);
    for (int world = 1; world <= 5; ++world) {
      CAPTURE(world);
      DCOMM_REQUIRE_WORLD(world, [world](comm& c, int r) -> asio::awaitable<void> {
        dcomm::agreement yes = co_await c.agree(true, patient());
        require(yes.flag && yes.failed.empty(), "all true: " + std::to_string(yes.flag));
        dcomm::agreement no = co_await c.agree(r != world - 1);
        require(!no.flag && no.failed.empty(), "one false: " + std::to_string(no.flag));
        // Revoked, and the members made different numbers of calls since:
        // agreements still meet (they are numbered apart).
        if (r == 0) c.revoke("recovering");
        for (int call = 0; call <= r; ++call)
          co_await failure_of([&] { return c.barrier(patient()); });
        dcomm::agreement after = co_await c.agree(true, patient());
        require(after.flag && after.failed.empty(), "on the revoked group");
      });
    }
  }

  TEST_CASE("agree: a member gone before the agreement is failed in every survivor's decision") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(4, [](comm& c, int r) -> asio::awaitable<void> {
      co_await c.barrier(patient());
      if (r == 1) co_return;  // its links close
      dcomm::agreement a = co_await c.agree(r != 3, patient());
      require(!a.flag && a.failed == std::vector<int>{1},
              "flag " + std::to_string(a.flag) + ", " + std::to_string(a.failed.size()) +
                  " failed");
    });
  }

  TEST_CASE("revoke fails every member's pending and later calls, and its groups', naming why") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(4, [](comm& c, int r) -> asio::awaitable<void> {
      std::optional<comm> pair = c.new_group({1, 2});  // made before the revocation
      co_await c.barrier(patient());
      const auto since = std::chrono::steady_clock::now();
      std::vector<float> v(1000, 1.0f);
      if (r == 0) {
        co_await sleep_for(200ms);  // the others are in their calls by then
        c.revoke("rolling back step 7");
        auto mine = co_await failure_of([&] { return c.all_reduce(v, dcomm::sum, patient()); });
        require(contains(mine.second, "this rank revoked the world group"), mine.second);
        require_revoked(mine, 0, "rolling back step 7", since, "the revoker's next call");
      } else if (r == 3) {
        // A receive from the revoker, pending: point to point fails too.
        auto pending = co_await failure_of([&] { return c.recv(v, 0, 5, patient()); });
        require_revoked(pending, 0, "rolling back step 7", since, "rank 3's pending recv");
      } else {
        // An all_reduce rank 0 never joins.
        auto pending = co_await failure_of([&] { return c.all_reduce(v, dcomm::sum, patient()); });
        require_revoked(pending, 0, "rolling back step 7", since, "a pending all_reduce");
        require(contains(pending.second, "rank 0 revoked the world group"), pending.second);
        // The pair was made from the world: revoked with it.
        auto child = co_await failure_of([&] { return pair->barrier(patient()); });
        require_revoked(child, 0, "rolling back step 7", since, "the pair's barrier");
        require(contains(child.second, "which this group was made from"), child.second);
      }
      // Later calls fail at once; so do those of a group made afterwards.
      auto later = co_await failure_of([&] { return c.broadcast(v, 1, patient()); });
      require_revoked(later, 0, "rolling back step 7", since, "a later broadcast");
      std::optional<comm> after = c.new_group({0, 1, 2, 3});
      auto born = co_await failure_of([&] { return after->barrier(patient()); });
      require_revoked(born, 0, "rolling back step 7", since, "a group made after");
    });
  }

  TEST_CASE("revoking a group leaves the group it was made from, and its other groups, working") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(3, [](comm& c, int r) -> asio::awaitable<void> {
      std::optional<comm> pair = c.new_group({0, 1});
      std::optional<comm> other = c.new_group({1, 2});
      co_await c.barrier(patient());
      const auto since = std::chrono::steady_clock::now();
      std::vector<int> x{r};
      if (r == 0) {
        pair->revoke("");  // no reason given
      } else if (r == 1) {
        auto pending = co_await failure_of([&] { return pair->recv(x, 0, 1, patient()); });
        require_revoked(pending, 0, "rank 0 revoked group {0,1}", since, "the pair's recv");
      }
      std::vector<int> w{r + 1};
      co_await c.all_reduce(w, dcomm::sum, patient());
      require(w[0] == 6, "the world's all_reduce after: " + std::to_string(w[0]));
      if (other) {
        std::vector<int> y{r};
        co_await other->all_reduce(y, dcomm::sum, patient());
        require(y[0] == 3, "the other pair's all_reduce: " + std::to_string(y[0]));
      }
    });
  }

  TEST_CASE("a rank that hears of a revocation before it makes the group makes it revoked") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(3, [](comm& c, int r) -> asio::awaitable<void> {
      co_await c.barrier(patient());
      const auto since = std::chrono::steady_clock::now();
      if (r == 2) co_await sleep_for(300ms);  // late to make the group
      std::optional<comm> g = c.new_group({0, 1, 2});
      if (r == 0) g->revoke("a late joiner");
      auto failed = co_await failure_of([&] { return g->barrier(patient()); });
      require_revoked(failed, 0, "a late joiner", since, "the group's barrier");
      // The world was not revoked.
      co_await c.barrier(patient());
    });
  }

  TEST_CASE("revoke from another thread fails the calls pending on the communicator") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(2, [](comm& c, int r) -> asio::awaitable<void> {
      co_await c.barrier(patient());
      const auto since = std::chrono::steady_clock::now();
      std::thread revoker;
      if (r == 1)
        revoker = std::thread([c] {
          std::this_thread::sleep_for(200ms);
          c.revoke("from a watchdog thread");
        });
      std::vector<int> x{0};
      auto failed = co_await failure_of([&] {
        return r == 0 ? c.recv(x, 1, 0, patient()) : c.all_reduce(x, dcomm::sum, patient());
      });
      if (revoker.joinable()) revoker.join();
      require_revoked(failed, 1, "from a watchdog thread", since, "a pending call");
    });
  }

  TEST_CASE("revoke_on_failure: a lost rank's failure reaches ranks that do not talk to it") {
    DCOMM_TEST_DEADLINE(60s);
    dcomm::cpu_backend::options o;
    o.revoke_on_failure = true;
    auto errors = dcomm::test::comm_world(
        3,
        [](comm& c, int r) -> asio::awaitable<void> {
          std::optional<comm> pair = c.new_group({0, 1});
          co_await c.barrier(patient());
          if (r == 2) {
            co_await sleep_for(200ms);  // the others are out of the barrier
            co_return;                  // its communicator goes away: its links close
          }
          const auto since = std::chrono::steady_clock::now();
          std::vector<int> x{r};
          if (r == 0) {
            // Needs rank 2: fails with the loss itself, and revokes the world.
            auto own = co_await failure_of([&] { return c.recv(x, 2, 9, patient()); });
            require(own.first == dcomm::errc::peer_lost && contains(own.second, "rank 2"),
                    "rank 0's recv from rank 2: " + own.second);
            // Stays until rank 1 has heard (a rank that leaves at once may
            // close its links before its revoke frames are read).
            co_await sleep_for(500ms);
          } else {
            // Waits on rank 0 in a group without rank 2: only the
            // revocation ends it before its deadline.
            auto pending = co_await failure_of([&] { return pair->recv(x, 0, 3, patient()); });
            require_revoked(pending, 0, "peers rank 2", since, "rank 1's recv in the pair");
          }
        },
        20s, o);
    const std::string report = dcomm::test::summary(errors);
    INFO(report);
    CHECK(report.empty());
  }

  TEST_CASE("shrink: the survivors get a communicator of themselves, in their old order") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(4, [](comm& c, int r) -> asio::awaitable<void> {
      co_await c.barrier(patient());
      if (r == 1) co_return;  // its links close
      if (r == 0) {
        co_await sleep_for(200ms);  // the others are out of the barrier
        c.revoke("rank 1 is gone");
      }
      comm s = co_await c.shrink(patient());
      const std::vector<int> expected{0, 2, 3};
      require(s.size() == 3 && std::vector<int>(s.ranks().begin(), s.ranks().end()) == expected &&
                  s.global_rank(s.rank()) == r,
              "shrunk to " + std::to_string(s.size()) + " ranks, rank " + std::to_string(s.rank()));
      std::vector<int> v{r + 1};
      co_await s.all_reduce(v, dcomm::sum, patient());
      require(v[0] == 1 + 3 + 4, "the survivors' all_reduce: " + std::to_string(v[0]));
      std::vector<float> big(100000, s.rank() == 2 ? 1.5f : 0.0f);
      co_await s.broadcast(big, 2, patient());
      require(big[99999] == 1.5f, "a broadcast from the new rank 2");
      std::vector<int> x{r};
      if (s.rank() == 0) co_await s.send(x, 1, 4, patient());
      if (s.rank() == 1) {
        co_await s.recv(x, 0, 4, patient());
        require(x[0] == 0, "send/recv on the shrunk group");
      }
      // The old group stays revoked; groups made from the new one work.
      auto old = co_await failure_of([&] { return c.barrier(patient()); });
      require(old.first == dcomm::errc::revoked, "the old world: " + old.second);
      std::optional<comm> pair = s.new_group({0, 2});
      if (pair) co_await pair->barrier(patient());
      co_await s.barrier(patient());
    });
  }

  TEST_CASE("shrink without a failure: the same members, a new group") {
    DCOMM_TEST_DEADLINE(60s);
    DCOMM_REQUIRE_WORLD(3, [](comm& c, int r) -> asio::awaitable<void> {
      comm s = co_await c.shrink(patient());
      require(s.size() == 3 && s.rank() == r, "shrunk without a failure");
      std::vector<int> v{r};
      co_await s.all_reduce(v, dcomm::sum, patient());
      co_await c.all_reduce(v, dcomm::sum, patient());  // the old one works on too
      require(v[0] == 9, "all_reduce: " + std::to_string(v[0]));
    });
  }
}
