"""Fleet mode: one shared root, many nodes, one GC leader elected through etcd or Kubernetes."""
