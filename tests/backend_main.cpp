#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
// Counts heap allocations for the "cpu allocations" suite.
#define DCOMM_HEAP_COUNTER_IMPLEMENT
#include "support/heap_counter.hpp"
