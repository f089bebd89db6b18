/*
 * handle_table.h - opaque 64-bit handles for runtime objects (physical memory handles,
 * streams, events).  A handle names a slot and the slot's generation, so a stale, forged or
 * foreign value is recognised without ever being dereferenced.
 *
 * Layout of a handle: bits 56..63 the table's tag (which kind of object), bits 24..55 the
 * slot's generation, bits 0..23 the slot index + 1.  A handle is never 0.
 *
 * The table does no locking: the module that owns it guards it with its own lock.
 */
#ifndef NPUALLOC_HANDLE_TABLE_H
#define NPUALLOC_HANDLE_TABLE_H

#include <stddef.h>
#include <stdint.h>

typedef struct handle_slot {
    void *object;       /* NULL when free */
    uint32_t generation;
    uint32_t next_free; /* index + 1 of the next free slot, 0 = none */
} handle_slot;

typedef struct handle_table {
    handle_slot *slots;
    uint32_t capacity;
    uint32_t free_head; /* index + 1, 0 = none */
    uint32_t live;
    uint32_t first_generation; /* of new slots (0: 1); raised past all handed out when emptied */
    uint8_t tag;
} handle_table;

#define HANDLE_TABLE_MAX_SLOTS (1u << 24)

/* The layout, also for an owner that keeps slots of its own (context.c): index is the slot's, from 0. */
static inline uint64_t handle_make(uint8_t tag, uint32_t generation, uint32_t index)
{
    return (uint64_t)tag << 56 | (uint64_t)generation << 24 | (uint64_t)(index + 1);
}
static inline uint8_t handle_tag(uint64_t handle) { return (uint8_t)(handle >> 56); }
static inline uint32_t handle_generation(uint64_t handle) { return (uint32_t)(handle >> 24); }
/* The slot index + 1 (0: no slot). */
static inline uint32_t handle_index1(uint64_t handle) { return (uint32_t)(handle & (HANDLE_TABLE_MAX_SLOTS - 1)); }

/* Frees the slot array (the objects are the owner's); the table stays usable, and no handle it
 * gave out before will name an object it gives out after. */
void handle_table_destroy(handle_table *t);
/* Stores `object` and returns its handle, or 0 when out of memory or slots. */
uint64_t handle_table_insert(handle_table *t, void *object);
/* The object named by `handle`, or NULL if the handle is not live in this table. */
void *handle_table_get(const handle_table *t, uint64_t handle);
/* Forgets `handle`; returns its object, or NULL if it was not live. */
void *handle_table_remove(handle_table *t, uint64_t handle);

#endif
