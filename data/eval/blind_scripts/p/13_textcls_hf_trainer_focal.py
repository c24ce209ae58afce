#!/usr/bin/env python
"""Product-review sentiment (5-star -> 3 classes) with the HF Trainer.

Focal loss via a Trainer subclass, a callback that dumps the confusion matrix of
each evaluation to disk.

    torchrun --nproc_per_node=8 13_textcls_hf_trainer_focal.py --output_dir out/reviews \
        --per_device_train_batch_size 32 --learning_rate 2e-5 --num_train_epochs 3 \
        --eval_strategy epoch --save_strategy epoch --bf16
"""
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from datasets import load_dataset
from sklearn.metrics import confusion_matrix, f1_score
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

logger = logging.getLogger(__name__)
LABELS = ["negative", "neutral", "positive"]


@dataclass
class ScriptArgs:
    model_name_or_path: str = field(default="roberta-base")
    dataset_name: str = field(default="amazon_reviews_multi")
    dataset_config: Optional[str] = field(default="en")
    max_seq_length: int = field(default=256)
    focal_gamma: float = field(default=2.0)
    max_train_samples: Optional[int] = field(default=None)


def stars_to_label(stars):
    return 0 if stars <= 2 else (1 if stars == 3 else 2)


class FocalLossTrainer(Trainer):
    def __init__(self, *args, gamma=2.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.gamma = gamma

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits.float()
        logp = F.log_softmax(logits, dim=-1)
        logp_t = logp.gather(1, labels.unsqueeze(1)).squeeze(1)
        loss = (-(1.0 - logp_t.exp()) ** self.gamma * logp_t).mean()
        return (loss, outputs) if return_outputs else loss


class ConfusionDumpCallback(TrainerCallback):
    """compute_metrics stores the last confusion matrix; write it out from the main process."""

    def __init__(self, holder, out_dir):
        self.holder = holder
        self.out_dir = out_dir

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if not state.is_world_process_zero or "cm" not in self.holder:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"cm_step{state.global_step}.json"), "w") as f:
            json.dump({"labels": LABELS, "matrix": self.holder["cm"], "metrics": metrics}, f, indent=1)


def main():
    parser = HfArgumentParser((ScriptArgs, TrainingArguments))
    script_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        handlers=[logging.StreamHandler(sys.stdout)])
    logger.setLevel(logging.INFO if training_args.should_log else logging.WARN)
    set_seed(training_args.seed)

    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    raw = load_dataset(script_args.dataset_name, script_args.dataset_config)
    if script_args.max_train_samples:
        raw["train"] = raw["train"].select(range(script_args.max_train_samples))

    def tokenize(batch):
        enc = tokenizer(batch["review_title"], batch["review_body"], truncation=True,
                        max_length=script_args.max_seq_length)
        enc["labels"] = [stars_to_label(s) for s in batch["stars"]]
        return enc

    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized = raw.map(tokenize, batched=True, num_proc=8,
                            remove_columns=raw["train"].column_names)

    config = AutoConfig.from_pretrained(script_args.model_name_or_path, num_labels=len(LABELS),
                                        id2label=dict(enumerate(LABELS)),
                                        label2id={l: i for i, l in enumerate(LABELS)})
    model = AutoModelForSequenceClassification.from_pretrained(script_args.model_name_or_path, config=config)

    cm_holder = {}

    def compute_metrics(p):
        preds = np.argmax(p.predictions, axis=-1)
        cm_holder["cm"] = confusion_matrix(p.label_ids, preds, labels=list(range(len(LABELS)))).tolist()
        return {"accuracy": float((preds == p.label_ids).mean()),
                "macro_f1": f1_score(p.label_ids, preds, average="macro")}

    trainer = FocalLossTrainer(
        model=model,
        args=training_args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"],
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8),
        compute_metrics=compute_metrics,
        callbacks=[ConfusionDumpCallback(cm_holder, os.path.join(training_args.output_dir, "confusion"))],
        gamma=script_args.focal_gamma,
    )

    last_ckpt = None
    if os.path.isdir(training_args.output_dir) and training_args.resume_from_checkpoint is None:
        ckpts = [d for d in os.listdir(training_args.output_dir) if d.startswith("checkpoint-")]
        if ckpts:
            last_ckpt = os.path.join(training_args.output_dir,
                                     max(ckpts, key=lambda d: int(d.split("-")[-1])))
            logger.info("resuming from %s", last_ckpt)
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint or last_ckpt)
    trainer.save_model()
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()

    metrics = trainer.evaluate(eval_dataset=tokenized["test"], metric_key_prefix="test")
    trainer.log_metrics("test", metrics)
    trainer.save_metrics("test", metrics)


if __name__ == "__main__":
    main()
