"""The Trainer subclass of hf_trainer_compute_loss_reads_model_config.py with
the fix: the label count comes from self.model, the unwrapped model the
Trainer keeps, so compute_loss works with one GPU or several."""

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments


class WeightedTrainer(Trainer):
    def __init__(self, *args, class_weights=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.class_weights = class_weights

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits.view(-1, self.model.config.num_labels)
        loss = F.cross_entropy(logits, labels.view(-1), weight=self.class_weights.to(logits.device))
        return (loss, outputs) if return_outputs else loss


def main(train_set):
    model = AutoModelForSequenceClassification.from_pretrained("bert-base-uncased", num_labels=3)
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=16, num_train_epochs=1)
    trainer = WeightedTrainer(model=model, args=args, train_dataset=train_set, class_weights=torch.ones(3))
    trainer.train()
