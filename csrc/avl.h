/*
 * avl.h - an intrusive AVL tree: ordered sets without allocation.
 *
 * The caller embeds an avl_node in its objects and supplies the order.  Invariants (checked by
 * avl_check in tests): in-order traversal is strictly increasing under the order; every
 * node's height is 1 + max(child heights) and the two child heights differ by at most one;
 * parent links mirror child links.
 */
#ifndef NPUALLOC_AVL_H
#define NPUALLOC_AVL_H

#include <stdbool.h>
#include <stddef.h>

typedef struct avl_node {
    struct avl_node *left, *right, *parent;
    int height;
} avl_node;

typedef struct avl_tree {
    avl_node *root;
    size_t count;
} avl_tree;

/* <0, 0, >0 as a is before, equal to, after b. */
typedef int (*avl_order)(const avl_node *a, const avl_node *b);
/* <0, 0, >0 as the key is before, at, after node n. */
typedef int (*avl_key_order)(const void *key, const avl_node *n);

#define AVL_ENTRY(ptr, type, member) ((type *)((char *)(ptr) - offsetof(type, member)))

static inline void avl_init(avl_tree *t)
{
    t->root = NULL;
    t->count = 0;
}

/* Inserts n (which must not compare equal to a node already in the tree). */
void avl_insert(avl_tree *t, avl_node *n, avl_order order);
/* Links n where a search ended (`*link` is NULL, `parent` its parent) and rebalances: for
 * callers that search with an inline comparison instead of a function pointer. */
void avl_link(avl_tree *t, avl_node *n, avl_node *parent, avl_node **link);
void avl_remove(avl_tree *t, avl_node *n);
/* n takes old's place (links, height): for a node whose key is about to be set to old's
 * position in the order, without a removal and an insertion. */
void avl_replace(avl_tree *t, avl_node *old, avl_node *n);

avl_node *avl_find(const avl_tree *t, const void *key, avl_key_order order);
/* The last node at or before the key, or NULL. */
avl_node *avl_floor(const avl_tree *t, const void *key, avl_key_order order);
/* The first node at or after the key, or NULL. */
avl_node *avl_ceil(const avl_tree *t, const void *key, avl_key_order order);

avl_node *avl_first(const avl_tree *t);
avl_node *avl_last(const avl_tree *t);
avl_node *avl_next(const avl_node *n);
avl_node *avl_prev(const avl_node *n);

/* Verifies every invariant; returns false on the first violation. */
bool avl_check(const avl_tree *t, avl_order order);

#endif
