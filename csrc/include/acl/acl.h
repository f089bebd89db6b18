/* acl/acl.h - CANN programs include "acl/acl.h"; npualloc's ACL API is all in acl_rt.h. */
#ifndef NPUALLOC_ACL_ACL_H
#define NPUALLOC_ACL_ACL_H
#include "../acl_rt.h"
#endif
