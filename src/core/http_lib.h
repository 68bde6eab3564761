// cpp-httplib as Debian builds it. libcpp-httplib-dev ships httplib.h split
// into declarations and a compiled libcpp-httplib.so built with OpenSSL,
// zlib and Brotli (its pkg-config Cflags). Those macros change the layout of
// httplib's classes (Request holds an SSL* under CPPHTTPLIB_OPENSSL_SUPPORT,
// ClientImpl certificate fields), so every file that includes httplib.h must
// define them as the library was built, or it reads fields at the wrong
// offsets. Include this header, never <httplib.h> directly.
#pragma once

#ifndef CPPHTTPLIB_OPENSSL_SUPPORT
#define CPPHTTPLIB_OPENSSL_SUPPORT
#endif
#ifndef CPPHTTPLIB_ZLIB_SUPPORT
#define CPPHTTPLIB_ZLIB_SUPPORT
#endif
#ifndef CPPHTTPLIB_BROTLI_SUPPORT
#define CPPHTTPLIB_BROTLI_SUPPORT
#endif

#include <httplib.h>
