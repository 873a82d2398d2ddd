// expect first: dcomm needs C++20
// Compiled with -std=c++17: the first error names the standard, before Asio
// and the coroutines it cannot find.
#include <dcomm/dcomm.hpp>

int main() {}
