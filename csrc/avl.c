/* avl.c - see avl.h. */
#include "avl.h"

static inline int height(const avl_node *n) { return n ? n->height : 0; }

static inline void update_height(avl_node *n)
{
    int hl = height(n->left), hr = height(n->right);
    n->height = 1 + (hl > hr ? hl : hr);
}

/* Points whatever referred to `old` (its parent's link or the root) at `new_node`. */
static void replace_child(avl_tree *t, avl_node *parent, avl_node *old, avl_node *new_node)
{
    if (!parent)
        t->root = new_node;
    else if (parent->left == old)
        parent->left = new_node;
    else
        parent->right = new_node;
    if (new_node)
        new_node->parent = parent;
}

static avl_node *rotate_left(avl_tree *t, avl_node *x)
{
    avl_node *y = x->right;
    x->right = y->left;
    if (y->left)
        y->left->parent = x;
    replace_child(t, x->parent, x, y);
    y->left = x;
    x->parent = y;
    update_height(x);
    update_height(y);
    return y;
}

static avl_node *rotate_right(avl_tree *t, avl_node *x)
{
    avl_node *y = x->left;
    x->left = y->right;
    if (y->right)
        y->right->parent = x;
    replace_child(t, x->parent, x, y);
    y->right = x;
    x->parent = y;
    update_height(x);
    update_height(y);
    return y;
}

/* Restores heights and balance from n up after an insertion or removal below n (n's own height
 * still the one from before).  Stops at the first subtree whose height comes out as it was,
 * rotated or not: nothing above it can change then.  Removals used to walk to the root. */
static void rebalance(avl_tree *t, avl_node *n)
{
    while (n) {
        int old_height = n->height;
        int hl = height(n->left), hr = height(n->right);
        if (hl - hr > 1) {
            if (height(n->left->left) < height(n->left->right))
                rotate_left(t, n->left);
            n = rotate_right(t, n);
        } else if (hr - hl > 1) {
            if (height(n->right->right) < height(n->right->left))
                rotate_right(t, n->right);
            n = rotate_left(t, n);
        } else {
            n->height = 1 + (hl > hr ? hl : hr);
        }
        if (n->height == old_height)
            break;
        n = n->parent;
    }
}

void avl_link(avl_tree *t, avl_node *n, avl_node *parent, avl_node **link)
{
    n->left = n->right = NULL;
    n->parent = parent;
    n->height = 0; /* rebalance computes 1 and walks up */
    *link = n;
    t->count++;
    rebalance(t, n);
}

void avl_insert(avl_tree *t, avl_node *n, avl_order order)
{
    avl_node *parent = NULL, **link = &t->root;
    while (*link) {
        parent = *link;
        link = order(n, parent) < 0 ? &parent->left : &parent->right;
    }
    avl_link(t, n, parent, link);
}

void avl_replace(avl_tree *t, avl_node *old, avl_node *n)
{
    *n = *old;
    if (n->left)
        n->left->parent = n;
    if (n->right)
        n->right->parent = n;
    replace_child(t, n->parent, old, n);
}

void avl_remove(avl_tree *t, avl_node *n)
{
    avl_node *start; /* lowest node whose height may have changed */
    if (n->left && n->right) {
        /* Swap n with its successor s (leftmost of the right subtree), then unlink n. */
        avl_node *s = n->right;
        while (s->left)
            s = s->left;
        avl_node *s_right = s->right;
        if (s->parent == n) {
            start = s;
        } else {
            start = s->parent;
            start->left = s_right;
            if (s_right)
                s_right->parent = start;
            s->right = n->right;
            n->right->parent = s;
        }
        s->left = n->left;
        n->left->parent = s;
        s->height = n->height;
        replace_child(t, n->parent, n, s);
    } else {
        avl_node *child = n->left ? n->left : n->right;
        start = n->parent;
        replace_child(t, n->parent, n, child);
    }
    t->count--;
    rebalance(t, start);
}

avl_node *avl_find(const avl_tree *t, const void *key, avl_key_order order)
{
    avl_node *n = t->root;
    while (n) {
        int c = order(key, n);
        if (c == 0)
            return n;
        n = c < 0 ? n->left : n->right;
    }
    return NULL;
}

avl_node *avl_floor(const avl_tree *t, const void *key, avl_key_order order)
{
    avl_node *n = t->root, *best = NULL;
    while (n) {
        int c = order(key, n);
        if (c == 0)
            return n;
        if (c > 0) {
            best = n;
            n = n->right;
        } else {
            n = n->left;
        }
    }
    return best;
}

avl_node *avl_ceil(const avl_tree *t, const void *key, avl_key_order order)
{
    avl_node *n = t->root, *best = NULL;
    while (n) {
        int c = order(key, n);
        if (c == 0)
            return n;
        if (c < 0) {
            best = n;
            n = n->left;
        } else {
            n = n->right;
        }
    }
    return best;
}

avl_node *avl_first(const avl_tree *t)
{
    avl_node *n = t->root;
    while (n && n->left)
        n = n->left;
    return n;
}

avl_node *avl_last(const avl_tree *t)
{
    avl_node *n = t->root;
    while (n && n->right)
        n = n->right;
    return n;
}

avl_node *avl_next(const avl_node *n)
{
    if (n->right) {
        n = n->right;
        while (n->left)
            n = n->left;
        return (avl_node *)n;
    }
    while (n->parent && n->parent->right == n)
        n = n->parent;
    return n->parent;
}

avl_node *avl_prev(const avl_node *n)
{
    if (n->left) {
        n = n->left;
        while (n->right)
            n = n->right;
        return (avl_node *)n;
    }
    while (n->parent && n->parent->left == n)
        n = n->parent;
    return n->parent;
}

static int check_node(const avl_node *n, const avl_node *parent, size_t *count)
{
    if (!n)
        return 0;
    if (n->parent != parent)
        return -1;
    int hl = check_node(n->left, n, count);
    int hr = check_node(n->right, n, count);
    if (hl < 0 || hr < 0)
        return -1;
    int h = 1 + (hl > hr ? hl : hr);
    if (n->height != h || hl - hr > 1 || hr - hl > 1)
        return -1;
    (*count)++;
    return h;
}

bool avl_check(const avl_tree *t, avl_order order)
{
    size_t count = 0;
    if (check_node(t->root, NULL, &count) < 0 || count != t->count)
        return false;
    const avl_node *prev = NULL;
    for (const avl_node *n = avl_first(t); n; n = avl_next(n)) {
        if (prev && order(prev, n) >= 0)
            return false;
        prev = n;
    }
    return true;
}
