/*
 * sanitizer.h - whether this is built with ThreadSanitizer: gcc defines __SANITIZE_THREAD__, clang
 * answers __has_feature(thread_sanitizer).  The library tells TSan what it cannot see (common.h);
 * the tests leave out what TSan cannot follow.
 */
#ifndef NPUALLOC_SANITIZER_H
#define NPUALLOC_SANITIZER_H

#if defined(__SANITIZE_THREAD__)
#define NPUALLOC_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define NPUALLOC_TSAN 1
#endif
#endif

#endif
