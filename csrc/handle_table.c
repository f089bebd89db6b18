/* handle_table.c - see handle_table.h. */
#include "handle_table.h"

#include <stdlib.h>
#include <string.h>

#define GEN_MASK 0xFFFFFFFFu

void handle_table_destroy(handle_table *t)
{
    /* Slots made from now on start above every generation handed out, so a handle kept from
     * before (a shutdown, a fork child) never names a new object. */
    uint32_t next = t->first_generation;
    for (uint32_t i = 0; i < t->capacity; i++)
        if (t->slots[i].generation >= next)
            next = t->slots[i].generation + 1;
    free(t->slots);
    uint8_t tag = t->tag; /* the table stays usable, empty, with its tag */
    memset(t, 0, sizeof *t);
    t->tag = tag;
    t->first_generation = next;
}

static int grow(handle_table *t)
{
    uint32_t cap = t->capacity ? t->capacity * 2 : 64;
    if (cap > HANDLE_TABLE_MAX_SLOTS)
        cap = HANDLE_TABLE_MAX_SLOTS;
    if (cap <= t->capacity)
        return -1;
    handle_slot *slots = realloc(t->slots, cap * sizeof *slots);
    if (!slots)
        return -1;
    /* New slots join the free list in index order. */
    for (uint32_t i = t->capacity; i < cap; i++) {
        slots[i].object = NULL;
        slots[i].generation = t->first_generation ? t->first_generation : 1;
        slots[i].next_free = (i + 1 < cap) ? i + 2 : t->free_head;
    }
    t->free_head = t->capacity + 1;
    t->slots = slots;
    t->capacity = cap;
    return 0;
}

uint64_t handle_table_insert(handle_table *t, void *object)
{
    if (!object || (!t->free_head && grow(t) != 0))
        return 0;
    uint32_t index = t->free_head - 1;
    handle_slot *s = &t->slots[index];
    t->free_head = s->next_free;
    s->object = object;
    s->next_free = 0;
    t->live++;
    return handle_make(t->tag, s->generation, index);
}

static handle_slot *slot_of(const handle_table *t, uint64_t handle)
{
    uint32_t index1 = handle_index1(handle);
    if (handle_tag(handle) != t->tag || index1 == 0 || index1 > t->capacity)
        return NULL;
    handle_slot *s = &t->slots[index1 - 1];
    return (s->object && s->generation == handle_generation(handle)) ? s : NULL;
}

void *handle_table_get(const handle_table *t, uint64_t handle)
{
    handle_slot *s = slot_of(t, handle);
    return s ? s->object : NULL;
}

void *handle_table_remove(handle_table *t, uint64_t handle)
{
    handle_slot *s = slot_of(t, handle);
    if (!s)
        return NULL;
    void *object = s->object;
    s->object = NULL;
    s->generation = (s->generation + 1) & GEN_MASK;
    if (s->generation == 0)
        s->generation = 1;
    s->next_free = t->free_head;
    t->free_head = (uint32_t)(s - t->slots) + 1;
    t->live--;
    return object;
}
