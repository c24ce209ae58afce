"""Logit distillation from Qwen2.5-7B-Instruct into a LoRA-adapted Qwen2.5-0.5B, custom HF Trainer.

    torchrun --nproc_per_node=8 11_distill_trainer_lora.py --output_dir runs/distill-0.5b \
        --per_device_train_batch_size 4 --gradient_accumulation_steps 4 --learning_rate 2e-4 \
        --num_train_epochs 2 --bf16 --logging_steps 10 --eval_strategy steps --eval_steps 500 \
        --save_steps 500 --report_to tensorboard
"""
import json
import os
from dataclasses import dataclass, field
from typing import List

import torch
import torch.nn.functional as F
from accelerate import PartialState
from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


@dataclass
class DistillArgs:
    student: str = "Qwen/Qwen2.5-0.5B"
    teacher: str = "Qwen/Qwen2.5-7B-Instruct"
    dataset: str = "HuggingFaceH4/ultrachat_200k"
    max_len: int = 1024
    alpha: float = 0.5
    temperature: float = 2.0
    lora_r: int = 32
    sample_prompts: List[str] = field(default_factory=lambda: [
        "Explain why the sky is blue to a ten-year-old.",
        "Write a Python function that checks whether a string is a palindrome.",
        "What are the pros and cons of remote work?",
    ])


class DistillTrainer(Trainer):
    def __init__(self, *args, teacher=None, alpha=0.5, temperature=2.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher = teacher.to(self.args.device).eval()
        self.teacher.requires_grad_(False)
        self.alpha = alpha
        self.temperature = temperature
        # our loss is a per-batch mean, let the Trainer scale it for gradient accumulation
        self.model_accepts_loss_kwargs = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        with torch.no_grad():
            t_logits = self.teacher(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits

        s_logits = outputs.logits[:, :-1]
        t_logits = t_logits[:, :-1]
        vocab = min(s_logits.size(-1), t_logits.size(-1))
        s_logits, t_logits = s_logits[..., :vocab].float(), t_logits[..., :vocab].float()
        tgt = labels[:, 1:]
        mask = tgt != -100

        ce = F.cross_entropy(s_logits.reshape(-1, vocab), tgt.reshape(-1), ignore_index=-100)
        T = self.temperature
        kl = F.kl_div(F.log_softmax(s_logits / T, -1), F.log_softmax(t_logits / T, -1),
                      log_target=True, reduction="none").sum(-1)
        kd = (kl * mask).sum() / mask.sum().clamp(min=1) * (T * T)
        loss = self.alpha * ce + (1 - self.alpha) * kd
        return (loss, outputs) if return_outputs else loss


class SampleGenerationCallback(TrainerCallback):
    """Greedy-decodes a few prompts after each evaluation and appends them to samples.jsonl."""

    def __init__(self, tokenizer, prompts, max_new_tokens=128):
        self.tok = tokenizer
        self.prompts = prompts
        self.max_new_tokens = max_new_tokens

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        # `model` here is the bare PEFT model, not the DDP wrapper: no collectives involved
        was_training = model.training
        model.eval()
        records = []
        for prompt in self.prompts:
            text = self.tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                add_generation_prompt=True)
            enc = self.tok(text, return_tensors="pt").to(model.device)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                out = model.generate(**enc, max_new_tokens=self.max_new_tokens, do_sample=False,
                                     use_cache=True, pad_token_id=self.tok.pad_token_id)
            records.append({"step": state.global_step, "prompt": prompt,
                            "completion": self.tok.decode(out[0, enc["input_ids"].shape[1]:],
                                                          skip_special_tokens=True)})
        with open(os.path.join(args.output_dir, "samples.jsonl"), "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        if was_training:
            model.train()


def main():
    parser = HfArgumentParser((DistillArgs, TrainingArguments))
    dargs, targs = parser.parse_args_into_dataclasses()
    targs.remove_unused_columns = False
    targs.gradient_checkpointing = True
    targs.gradient_checkpointing_kwargs = {"use_reentrant": False}
    targs.ddp_find_unused_parameters = False
    targs.prediction_loss_only = True

    state = PartialState()
    device_map = {"": state.local_process_index}

    tok = AutoTokenizer.from_pretrained(dargs.student)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    def encode(ex):
        msgs = ex["messages"]
        prompt = tok.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(msgs, tokenize=False)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        f_ids = tok(full, add_special_tokens=False)["input_ids"][: dargs.max_len]
        labels = [-100] * min(len(p_ids), len(f_ids)) + f_ids[len(p_ids):]
        return {"input_ids": f_ids, "attention_mask": [1] * len(f_ids), "labels": labels}

    with state.main_process_first():
        ds = load_dataset(dargs.dataset)
        train = ds["train_sft"].map(encode, remove_columns=ds["train_sft"].column_names, num_proc=16)
        evald = ds["test_sft"].select(range(2000)).map(encode, remove_columns=ds["test_sft"].column_names)

    student = AutoModelForCausalLM.from_pretrained(dargs.student, torch_dtype=torch.bfloat16,
                                                   device_map=device_map)
    student.config.use_cache = False
    student = get_peft_model(student, LoraConfig(r=dargs.lora_r, lora_alpha=2 * dargs.lora_r, lora_dropout=0.05,
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))
    teacher = AutoModelForCausalLM.from_pretrained(dargs.teacher, torch_dtype=torch.bfloat16,
                                                   device_map=device_map)

    trainer = DistillTrainer(
        model=student,
        args=targs,
        train_dataset=train,
        eval_dataset=evald,
        data_collator=DataCollatorForSeq2Seq(tok, padding=True, pad_to_multiple_of=8),
        tokenizer=tok,
        teacher=teacher,
        alpha=dargs.alpha,
        temperature=dargs.temperature,
        callbacks=[SampleGenerationCallback(tok, dargs.sample_prompts)],
    )
    if state.is_main_process:
        student.print_trainable_parameters()

    trainer.train(resume_from_checkpoint=targs.resume_from_checkpoint)
    trainer.save_model(os.path.join(targs.output_dir, "final"))
    if trainer.is_world_process_zero():
        tok.save_pretrained(os.path.join(targs.output_dir, "final"))
    state.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
