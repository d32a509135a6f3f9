// The emulator's stand-in for CUDA's runtime header: kernels/simt/simt.h (kernels/simt/__init__.py
// puts this directory first on the include path of its g++ builds).
#pragma once
#include "../simt.h"
