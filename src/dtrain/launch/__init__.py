"""Starting ranks: dtrain's launcher on torch's elastic agent."""
