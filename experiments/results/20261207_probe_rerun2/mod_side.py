open('/tmp/pr2/tc/SIDE_EFFECT', 'w').write('imported')
class Thing: pass
