// lora.h: LoRA adapters (Hu et al. 2021) as Hugging Face PEFT defines them
// (peft/tuners/lora/layer.py, config.py), and the NF4 storage of base
// weights that QLoRA (Dettmers et al. 2023) trains them on, as bitsandbytes
// defines it (bitsandbytes/functional.py, nn/modules.py Linear4bit).
//
// Both live inside the linear unit (fl_linear_forward/backward), one code
// path for every architecture: y = W x + scaling * B(A(dropout(x))), with W
// stored in the model's dtype or in NF4 and dequantised one weight matrix at
// a time into workspace, never as a whole model.
//
// The adapters are a parameter set of their own (fl_lora: a table of named
// views over one flat buffer of the model's dtype, like the base's), so the
// optimizer, the checkpoints and the PEFT files see them as rows. The base
// is frozen (no gradient buffer, no optimizer state) unless train_base:
// LoRA + LOMO, where a fused optimizer updates the base in the same backward.
#ifndef FITLM_LORA_H
#define FITLM_LORA_H

#include <stddef.h>
#include <stdint.h>

#include "fitlm/config.h"
#include "fitlm/params.h"
#include "fitlm/shape.h" // fl_lora_config, fl_quant_config: plain settings the config reads

// The LoRA section of a run's config (src/model/lora_config.c): lora.*
// keys only with LoRA (an adapter turns it on), PEFT's choices fitlm lacks
// refused; derives cfg->lora.init and cfg->lora.train_base. After the batch
// (it reads the accumulation).
void fl_lora_check_config(fl_train_config *cfg);
void fl_lora_config_defaults(fl_lora_config *c);
float fl_lora_scaling(const fl_lora_config *c);

// The adapters' rows for a base table: for each targeted base row
// "<module>.weight" (out, in), in table order, "<module>.lora_A.weight"
// (r, in) then "<module>.lora_B.weight" (out, r), each with its base row's
// unit. Dies naming an entry of target_modules that matches no module, or a
// match that is not a linear layer of a block (embeddings, norms, LM head).
// a_row (base->count ints, may be NULL) receives each base row's lora_A row
// in t, or -1.
void fl_lora_table(fl_param_table *t, const fl_param_table *base, const fl_model_config *c,
                   const fl_lora_config *lc, int *a_row);

// The Hugging Face module name of a base or adapter row ("model." /
// "transformer." prefix, no ".weight"), e.g. "model.layers.0.self_attn.q_proj"
// for "layers.0.self_attn.q_proj.lora_A.weight".
void fl_lora_module_name(const fl_model_config *c, const char *row, char *out, size_t size);
// The name PEFT saves an adapter row under:
// "base_model.model.<module>.lora_A.weight" (or lora_B).
void fl_lora_peft_name(const fl_model_config *c, const char *row, char *out, size_t size);

// ----------------------------------------------------------------------------
// NF4 storage of base weights

#define FL_DQ_BLOCK 256 // double quantisation's block, bitsandbytes' fixed value

// The NF4 section of a run's config (src/model/quant_config.c): fp4
// refused, NF4 keys only with nf4, NF4 only under LoRA with a frozen base;
// derives cfg->quant.enabled. After fl_lora_check_config.
void fl_quant_check_config(fl_train_config *cfg);

// Which rows are stored in NF4: the linear layers of the blocks (2-D rows
// of a block unit); embeddings, norms and the LM head stay in the compute
// dtype, as transformers leaves them.
int fl_quant_row(const fl_param_view *v);
// Bytes of one row's NF4 storage: codes, absmax (fp32, or 8-bit codes plus
// the nested fp32 absmax and the offset with double quantisation).
size_t fl_quant_row_bytes(const fl_quant_config *q, size_t numel);
// Bytes per parameter of a table's NF4 rows (their storage over their
// count); *quantised receives the count (may be NULL).
double fl_quant_bytes_per_param(const fl_param_table *t, const fl_quant_config *q,
                                size_t *quantised);

#endif
