"""BERT-joint (Alberti et al. 2019) for Natural Questions: span head + answer-type head.

Kept to plain tensor ops (no data-dependent control flow in the inference path) so the same
module exports to ONNX and runs under torch.compile.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from transformers.modeling_outputs import ModelOutput
from transformers.models.bert.modeling_bert import BertModel, BertPreTrainedModel

NQ_OUTPUTS = ("start_logits", "end_logits", "answer_type_logits")
NUM_ANSWER_TYPES = 5  # UNKNOWN, YES, NO, SHORT, LONG (see nq/features.py)


@dataclass
class NQModelOutput(ModelOutput):
    loss: Optional[torch.FloatTensor] = None
    start_logits: Optional[torch.FloatTensor] = None
    end_logits: Optional[torch.FloatTensor] = None
    answer_type_logits: Optional[torch.FloatTensor] = None
    hidden_states: Optional[tuple[torch.FloatTensor, ...]] = None
    attentions: Optional[tuple[torch.FloatTensor, ...]] = None


class BertJointForNaturalQuestions(BertPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        # The pooler is needed: the answer-type head reads the pooled [CLS] as in BERT-joint.
        self.bert = BertModel(config, add_pooling_layer=True)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.answer_type_outputs = nn.Linear(config.hidden_size, NUM_ANSWER_TYPES)
        self.post_init()

    def forward(self, input_ids: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                token_type_ids: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                inputs_embeds: Optional[torch.Tensor] = None, start_positions: Optional[torch.Tensor] = None,
                end_positions: Optional[torch.Tensor] = None, answer_types: Optional[torch.Tensor] = None,
                return_dict: Optional[bool] = None, **kwargs):
        outputs = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                            position_ids=position_ids, inputs_embeds=inputs_embeds, return_dict=True, **kwargs)
        sequence_output, pooled_output = outputs[0], outputs[1]
        logits = self.qa_outputs(sequence_output)
        start_logits, end_logits = logits.split(1, dim=-1)
        start_logits = start_logits.squeeze(-1).contiguous()
        end_logits = end_logits.squeeze(-1).contiguous()
        answer_type_logits = self.answer_type_outputs(pooled_output)

        loss = None
        if start_positions is not None and end_positions is not None:
            # Out-of-range positions are ignored rather than crashing a long training run.
            ignored = start_logits.size(1)
            ce = nn.CrossEntropyLoss(ignore_index=ignored)
            start_loss = ce(start_logits, start_positions.view(-1).clamp(0, ignored))
            end_loss = ce(end_logits, end_positions.view(-1).clamp(0, ignored))
            if answer_types is not None:
                type_loss = nn.functional.cross_entropy(answer_type_logits, answer_types.view(-1))
                loss = (start_loss + end_loss + type_loss) / 3
            else:
                loss = (start_loss + end_loss) / 2

        out = NQModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits,
                            answer_type_logits=answer_type_logits, hidden_states=outputs.hidden_states,
                            attentions=outputs.attentions)
        if return_dict is False:
            return out.to_tuple()
        return out
