#!/usr/bin/env python
# n2c2 2018 Track 2: medication -> attribute relation classification
# (Strength, Dosage, Route, Frequency, Form, Duration, Reason, ADE).
# Candidate pairs come from prep_n2c2_pairs.py; the two arguments are wrapped in typed entity markers
# and the concatenated "entity start" representation is classified (Baldini Soares et al. style).
#
#   torchrun --nproc_per_node=8 03_re_n2c2_trainer.py \
#       --model_name_or_path microsoft/BiomedNLP-PubMedBERT-base-uncased-abstract-fulltext \
#       --data_dir data/n2c2_2018_pairs --output_dir out/n2c2_re_pubmedbert

import argparse
import logging
import os

import numpy as np
import torch
import torch.nn as nn
from datasets import load_dataset
from sklearn.metrics import precision_recall_fscore_support
from transformers import (AutoConfig, AutoModel, AutoTokenizer, BertConfig, DataCollatorWithPadding,
                          PreTrainedModel, Trainer, TrainingArguments, set_seed)
from transformers.modeling_outputs import SequenceClassifierOutput

logger = logging.getLogger(__name__)

RELATIONS = ["NONE", "Strength-Drug", "Dosage-Drug", "Route-Drug", "Frequency-Drug",
             "Form-Drug", "Duration-Drug", "Reason-Drug", "ADE-Drug"]
ENTITY_TYPES = ["Drug", "Strength", "Dosage", "Route", "Frequency", "Form", "Duration", "Reason", "ADE"]
MARKERS = [f"<{t}>" for t in ENTITY_TYPES] + [f"</{t}>" for t in ENTITY_TYPES]


class EntityStartClassifier(PreTrainedModel):
    config_class = BertConfig
    supports_gradient_checkpointing = True

    def __init__(self, config, encoder=None):
        super().__init__(config)
        self.encoder = encoder if encoder is not None else AutoModel.from_config(config, add_pooling_layer=False)
        hidden = config.hidden_size
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.GELU(),
                                        nn.Dropout(config.hidden_dropout_prob),
                                        nn.Linear(hidden, config.num_labels))

    def forward(self, input_ids, attention_mask, head_start, tail_start, labels=None, token_type_ids=None):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                         token_type_ids=token_type_ids).last_hidden_state
        idx = torch.arange(h.size(0), device=h.device)
        rep = torch.cat([h[idx, head_start], h[idx, tail_start]], dim=-1)
        logits = self.classifier(self.dropout(rep))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def build_compute_metrics():
    positive = list(range(1, len(RELATIONS)))

    def compute_metrics(eval_pred):
        logits, labels = eval_pred
        preds = logits.argmax(-1)
        p, r, f, _ = precision_recall_fscore_support(labels, preds, labels=positive, average="micro",
                                                     zero_division=0)
        _, _, macro_f, _ = precision_recall_fscore_support(labels, preds, labels=positive, average="macro",
                                                           zero_division=0)
        return {"precision": p, "recall": r, "micro_f1": f, "macro_f1": macro_f}

    return compute_metrics


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_name_or_path", required=True)
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--max_length", type=int, default=256)
    ap.add_argument("--epochs", type=float, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--per_device_batch_size", type=int, default=32)
    ap.add_argument("--grad_accum", type=int, default=1)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--report_to", default="wandb")
    args = ap.parse_args()

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        learning_rate=args.lr,
        warmup_ratio=0.06,
        weight_decay=0.01,
        per_device_train_batch_size=args.per_device_batch_size,
        per_device_eval_batch_size=args.per_device_batch_size * 2,
        gradient_accumulation_steps=args.grad_accum,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        ddp_find_unused_parameters=False,
        bf16=args.bf16,
        eval_strategy="epoch",
        save_strategy="epoch",
        save_total_limit=2,
        load_best_model_at_end=True,
        metric_for_best_model="micro_f1",
        logging_steps=50,
        dataloader_num_workers=4,
        remove_unused_columns=False,
        report_to=[args.report_to],
        run_name=os.path.basename(args.output_dir.rstrip("/")),
        seed=args.seed,
    )
    logging.basicConfig(level=logging.INFO if training_args.should_log else logging.WARN,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    set_seed(training_args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    label2id = {r: i for i, r in enumerate(RELATIONS)}

    raw = load_dataset("json", data_files={"train": os.path.join(args.data_dir, "train.jsonl"),
                                           "validation": os.path.join(args.data_dir, "dev.jsonl")})

    def encode(batch):
        enc = tokenizer(batch["marked_text"], truncation=True, max_length=args.max_length)
        heads, tails = [], []
        for ids, htype, ttype in zip(enc["input_ids"], batch["head_type"], batch["tail_type"]):
            h_id = tokenizer.convert_tokens_to_ids(f"<{htype}>")
            t_id = tokenizer.convert_tokens_to_ids(f"<{ttype}>")
            # pairs whose marker was truncated away fall back to [CLS]
            heads.append(ids.index(h_id) if h_id in ids else 0)
            tails.append(ids.index(t_id) if t_id in ids else 0)
        enc["head_start"] = heads
        enc["tail_start"] = tails
        enc["labels"] = [label2id[r] for r in batch["relation"]]
        return enc

    with training_args.main_process_first(desc="tokenising pairs"):
        tokenized = raw.map(encode, batched=True, remove_columns=raw["train"].column_names,
                            load_from_cache_file=True, desc="tokenising")

    config = AutoConfig.from_pretrained(args.model_name_or_path, num_labels=len(RELATIONS),
                                        id2label=dict(enumerate(RELATIONS)), label2id=label2id)
    encoder = AutoModel.from_pretrained(args.model_name_or_path, add_pooling_layer=False)
    encoder.resize_token_embeddings(len(tokenizer))
    model = EntityStartClassifier(config, encoder=encoder)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"],
        tokenizer=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8),
        compute_metrics=build_compute_metrics(),
    )
    train_result = trainer.train()
    trainer.save_model()
    trainer.log_metrics("train", train_result.metrics)
    trainer.save_metrics("train", train_result.metrics)

    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(args.output_dir)
        logger.info("dev micro-F1 %.4f macro-F1 %.4f", metrics["eval_micro_f1"], metrics["eval_macro_f1"])


if __name__ == "__main__":
    main()
