/* ptr_map.c - see ptr_map.h. */
#include "ptr_map.h"

#include <stdlib.h>

static int grow(ptr_map *m)
{
    size_t cap = m->mask ? (m->mask + 1) * 2 : 64;
    ptr_map_entry *slots = calloc(cap, sizeof *slots);
    if (!slots)
        return -1;
    ptr_map old = *m;
    m->slots = slots;
    m->mask = cap - 1;
    m->shift = (unsigned)__builtin_clzll((unsigned long long)cap) + 1; /* 64 - log2(cap) */
    if (old.slots) {
        for (size_t i = 0; i <= old.mask; i++) {
            if (!old.slots[i].key)
                continue;
            size_t j = ptr_map_slot(m, old.slots[i].key);
            while (m->slots[j].key)
                j = (j + 1) & m->mask;
            m->slots[j] = old.slots[i];
        }
        free(old.slots);
    }
    return 0;
}

int ptr_map_grow_for(ptr_map *m, size_t extra)
{
    while (!ptr_map_has_room(m, extra))
        if (grow(m) != 0)
            return -1;
    return 0;
}

int ptr_map_put(ptr_map *m, uintptr_t key, void *value)
{
    if (ptr_map_reserve(m, 1) != 0)
        return -1;
    ptr_map_put_reserved(m, key, value);
    return 0;
}

void *ptr_map_get(const ptr_map *m, uintptr_t key)
{
    if (!m->count || !key)
        return NULL;
    for (size_t i = ptr_map_slot(m, key);; i = (i + 1) & m->mask) {
        if (m->slots[i].key == key)
            return m->slots[i].value;
        if (!m->slots[i].key)
            return NULL;
    }
}

void *ptr_map_remove(ptr_map *m, uintptr_t key)
{
    if (!m->count || !key)
        return NULL;
    size_t i = ptr_map_slot(m, key);
    while (m->slots[i].key != key) {
        if (!m->slots[i].key)
            return NULL;
        i = (i + 1) & m->mask;
    }
    void *value = m->slots[i].value;
    /* Backward shift: pull later entries of the same probe run into the hole. */
    size_t hole = i;
    for (size_t j = (i + 1) & m->mask; m->slots[j].key; j = (j + 1) & m->mask) {
        size_t home = ptr_map_slot(m, m->slots[j].key);
        /* Move j into the hole unless its home lies cyclically in (hole, j]. */
        if (((j - home) & m->mask) >= ((j - hole) & m->mask)) {
            m->slots[hole] = m->slots[j];
            hole = j;
        }
    }
    m->slots[hole].key = 0;
    m->slots[hole].value = NULL;
    m->count--;
    return value;
}

void ptr_map_free(ptr_map *m)
{
    free(m->slots);
    m->slots = NULL;
    m->mask = 0;
    m->count = 0;
}
