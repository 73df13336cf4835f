// Device helpers of the C++ that jitattn/variants/render.py writes from a traced variant.
#pragma once
