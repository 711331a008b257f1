/* Ends a float vector layer's instance: the names every vecf_<isa>.h defines. */
#undef XN
#undef XT
#undef XF
#undef XFN
#undef VECF
#undef VECI
#undef XHALF
#undef XMASK
#undef XLIVE
#undef LANES
#undef X_MASKED_TAILS
#undef X_GROUP_FACTOR
#undef X_GEMM_NR
#undef X_QK_QUERIES
#undef X_PV_WIDE
#undef X_EXP_MAX
#undef X_KEYS
