/* acl/acl_rt.h - CANN programs include "acl/acl_rt.h"; it is npualloc's acl_rt.h. */
#ifndef NPUALLOC_ACL_ACL_RT_H
#define NPUALLOC_ACL_ACL_RT_H
#include "../acl_rt.h"
#endif
