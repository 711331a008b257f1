/* Ends a vector layer's instance: the names every vec_<isa>.h defines. */
#undef VN
#undef VF
#undef VFN
#undef V_LO_WU
#undef V_HI_WU
#undef V_BYTES_Q8
#undef V_TOKENS
#undef V_PASS_TOKENS
#undef V_WORDS_FROM
#undef V_INT_PREFILL
