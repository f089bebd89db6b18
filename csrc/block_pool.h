/*
 * block_pool.h - a pool of free cached blocks, ordered as torch orders them: by stream, then
 * size, then address.  The allocator's best fit is the first block at or after
 * (stream, size) that still belongs to the stream.
 *
 * Index: per stream, free blocks sit in size-class bins (exact classes below 32 KiB, 16 per
 * power of two above), each bin ordered by (size, address): a sorted list while short, a tree
 * beyond (block_pool.c).  A two-level bitmap finds the next non-empty bin at once.  A search
 * touches the request's own bin and at most one more, so its cost does not grow with the number
 * of free blocks of other sizes.
 *
 * Invariant: a block is in exactly one pool's index while it is free and mapped
 * (block->in_pool), in the pool's unmapped set while it is unmapped address space of an
 * expandable segment, and in neither while allocated or waiting for events.
 */
#ifndef NPUALLOC_BLOCK_POOL_H
#define NPUALLOC_BLOCK_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "avl.h"

typedef struct cache_block cache_block;
typedef struct private_pool private_pool;
typedef struct stream_bins stream_bins;

typedef struct block_pool {
    stream_bins **streams; /* one per stream used with the pool, sorted by stream handle */
    size_t stream_count, stream_capacity;
    size_t count;          /* free blocks indexed */
    avl_tree unmapped;     /* unmapped address space of expandable segments, ordered (stream, ptr) */
    bool is_small;
    bool no_split;         /* torch's no_split_pools: its blocks are handed out whole (should_split) */
    uint64_t search_count; /* free-block searches while garbage collection is on: a block's age
                              is search_count - block->gc_base */
    private_pool *owner;   /* NULL for the device's default pools */
} block_pool;

void block_pool_init(block_pool *p, bool is_small, private_pool *owner);
/* Frees the index (the blocks are the caller's). */
void block_pool_destroy(block_pool *p);
/* Makes sure a stream's bins exist, so inserting its blocks cannot fail later; -1 when out
 * of memory.  Every block of a stream enters the pool after an allocation on that stream. */
int block_pool_prepare(block_pool *p, uint64_t stream);

/* A block keeps its pool and stream for life (cache_block_new hands out zeroed structs). */
void block_pool_insert(block_pool *p, cache_block *b);
void block_pool_remove(block_pool *p, cache_block *b);
/* Gives an indexed block a new (ptr, size), keeping its place when the order allows (a split
 * or merge mostly leaves a block between the same neighbours), else moving it.  b's own key may
 * be stale when this is called; every other block's must be current. */
void block_pool_rekey(block_pool *p, cache_block *b, uintptr_t ptr, size_t size);
/* b (same stream, not indexed) takes old's place in the index and old leaves it: the first
 * step of merging b with a free neighbour.  b's key is stale until block_pool_rekey. */
void block_pool_transplant(cache_block *old, cache_block *b);
/* The first block ordered at or after (stream, size, 0), or NULL (any stream). */
cache_block *block_pool_lower_bound(const block_pool *p, uint64_t stream, size_t size);
/* Neighbours in the pool's order (any stream). */
cache_block *block_pool_next(const cache_block *b);
cache_block *block_pool_prev(const cache_block *b);
cache_block *block_pool_first(const block_pool *p);
/* The largest block of a stream, or NULL. */
cache_block *block_pool_last_of_stream(const block_pool *p, uint64_t stream);
size_t block_pool_count(const block_pool *p);
/* Verifies the index's invariants (the heap checker of the tests): every bin's order, links,
 * count and bitmap bits, and every block's record of where it is.  False on the first
 * violation. */
bool block_pool_check(const block_pool *p);

/* The unmapped set (expandable segments). */
void block_pool_insert_unmapped(block_pool *p, cache_block *b);
void block_pool_remove_unmapped(block_pool *p, cache_block *b);
/* The lowest-addressed unmapped block of a stream, and the next one of any stream. */
cache_block *block_pool_first_unmapped(const block_pool *p, uint64_t stream);
cache_block *block_pool_next_unmapped(const cache_block *b);

#endif
