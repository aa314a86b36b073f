// Registration macro used by every op of this library.
//
// FastDeploy registers its ops with PD_BUILD_STATIC_OP(name), which names them
// "static_op_<name>". Paddle ships the macro in some versions only, so we define
// it here when missing; the op names are the same either way.
#pragma once

#include "paddle/extension.h"

#ifndef PD_BUILD_STATIC_OP
#define PD_BUILD_STATIC_OP(name) PD_BUILD_OP(static_op_##name)
#endif
