/*
 * ptr_map.h - a hash table from device pointers to blocks (open addressing, linear probing,
 * backward-shift deletion).  Lookups and removals never allocate; an insertion allocates only
 * when the table grows past a quarter full, so steady-state allocation makes no heap calls.
 * Why a quarter: probe runs stay short (the recorded trace's pair: 118 -> 110 ns against half
 * full), for 64 bytes of table per live block instead of 32.
 * A key's home slot is the top bits of its Fibonacci hash, which depend on every bit of the key:
 * taking middle bits of the product instead ignored the high bits, so pointers at the same
 * offset of segments far apart shared a probe run (trace pair 110 -> about 106 ns).
 * Key 0 marks an empty slot (a device pointer is never 0).
 */
#ifndef NPUALLOC_PTR_MAP_H
#define NPUALLOC_PTR_MAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct ptr_map_entry {
    uintptr_t key;
    void *value;
} ptr_map_entry;

typedef struct ptr_map {
    ptr_map_entry *slots;
    size_t mask; /* capacity - 1 (capacity a power of two), 0 while empty */
    size_t count;
    unsigned shift; /* 64 - log2(capacity): a slot is the top bits of the key's hash */
} ptr_map;

/* Can the table take `extra` more keys and stay at most a quarter full (see above)? */
static inline int ptr_map_has_room(const ptr_map *m, size_t extra)
{
    return m->mask != 0 && (m->count + extra) * 4 <= m->mask + 1;
}

/* Makes room for `extra` more keys: afterwards that many ptr_map_put calls cannot fail.
 * Returns 0, or -1 when out of memory. */
int ptr_map_grow_for(ptr_map *m, size_t extra);
static inline int ptr_map_reserve(ptr_map *m, size_t extra)
{
    if (__builtin_expect(ptr_map_has_room(m, extra), 1))
        return 0;
    return ptr_map_grow_for(m, extra);
}
static inline size_t ptr_map_slot(const ptr_map *m, uintptr_t key)
{
    /* Fibonacci hashing: the product's top bits depend on every bit of the key. */
    return (size_t)(((uint64_t)key * 0x9E3779B97F4A7C15ull) >> m->shift);
}

/* The entry of `key` (not 0), inserted with value NULL when absent; after a successful
 * ptr_map_reserve, so it cannot fail.  Inline for the allocator's hot path, which reserves before
 * it changes anything. */
static inline ptr_map_entry *ptr_map_entry_reserved(ptr_map *m, uintptr_t key)
{
    size_t i = ptr_map_slot(m, key);
    while (m->slots[i].key != key) {
        if (!m->slots[i].key) {
            m->slots[i].key = key;
            m->slots[i].value = NULL;
            m->count++;
            break;
        }
        i = (i + 1) & m->mask;
    }
    return &m->slots[i];
}

static inline void ptr_map_put_reserved(ptr_map *m, uintptr_t key, void *value)
{
    ptr_map_entry_reserved(m, key)->value = value;
}

/* The entry of `key` (not 0), inserted with value NULL when absent: one probe sequence for a
 * lookup that may insert (the replay's recorded addresses).  NULL when out of memory.  The entry
 * stays valid until the map next changes. */
static inline ptr_map_entry *ptr_map_find_or_insert(ptr_map *m, uintptr_t key)
{
    if (__builtin_expect(ptr_map_reserve(m, 1) != 0, 0))
        return NULL;
    return ptr_map_entry_reserved(m, key);
}

/* Returns 0, or -1 when out of memory (the map is unchanged). */
int ptr_map_put(ptr_map *m, uintptr_t key, void *value);
void *ptr_map_get(const ptr_map *m, uintptr_t key);
/* Removes key; returns its value or NULL. */
void *ptr_map_remove(ptr_map *m, uintptr_t key);
void ptr_map_free(ptr_map *m);

#endif
